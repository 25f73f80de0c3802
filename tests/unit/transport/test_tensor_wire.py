import pytest
import torch

from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.transport.tensor_wire import TensorAssembler, assemble, tensor_to_chunks


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
)
def test_round_trip_bit_exact(dtype):
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    chunks = list(tensor_to_chunks("x", t, chunk_bytes=16))
    assert len(chunks) > 1
    assert all(len(c.data) <= 16 for c in chunks)
    out = assemble(chunks, max_total_bytes=1 << 20)["x"]
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_empty_tensor_and_several_names():
    chunks = list(tensor_to_chunks("a", torch.empty(0, 4))) + list(tensor_to_chunks("b", torch.ones(2)))
    out = assemble(chunks, 1 << 20)
    assert out["a"].shape == (0, 4) and torch.equal(out["b"], torch.ones(2))


def test_budget_refused_before_allocating():
    chunks = tensor_to_chunks("x", torch.zeros(1000))
    with pytest.raises(ResourceExhausted, match="transfer limit of 100 bytes"):
        assemble(chunks, max_total_bytes=100)


def test_out_of_order_and_incomplete_rejected():
    chunks = list(tensor_to_chunks("x", torch.arange(100), chunk_bytes=64))
    asm = TensorAssembler(1 << 20)
    asm.add(chunks[0])
    with pytest.raises(InvalidRequest, match="out of order"):
        asm.add(chunks[2])
    asm2 = TensorAssembler(1 << 20)
    asm2.add(chunks[0])
    with pytest.raises(InvalidRequest, match="ended after"):
        asm2.tensors()


def test_header_must_agree_with_shape():
    first = next(tensor_to_chunks("x", torch.zeros(4)))
    first.total_bytes = 3
    with pytest.raises(InvalidRequest, match="shape and total_bytes disagree"):
        TensorAssembler(1 << 20).add(first)
