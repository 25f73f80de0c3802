"""Tensors on the wire: dtype + shape + raw bytes, split into chunks under the message limit.

No pickle. A tensor is sent as TensorChunk messages; the first carries dtype, shape and
total size, every chunk carries its byte offset. The receiver preallocates the whole buffer
and copies each chunk into place once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.server_config import CHUNK_BYTES
from epd.v1 import common_pb2

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def tensor_to_chunks(
    name: str, tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[common_pb2.TensorChunk]:
    """Yields the chunks of one tensor (at least one, even when empty)."""
    if tensor.dtype not in _NAMES:
        raise TypeError(f"cannot send dtype {tensor.dtype}")
    flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)  # [num_bytes]
    raw = memoryview(flat.numpy())  # type: ignore[arg-type]
    total = len(raw)
    offset = 0
    while True:
        piece = raw[offset : offset + chunk_bytes]
        msg = common_pb2.TensorChunk(name=name, offset_bytes=offset, data=piece.tobytes())
        if offset == 0:
            msg.dtype = _NAMES[tensor.dtype]
            msg.shape.extend(tensor.shape)
            msg.total_bytes = total
        yield msg
        offset += len(piece)
        if offset >= total:
            return


class TensorAssembler:
    """Rebuilds named tensors from chunks, enforcing a total byte budget."""

    def __init__(self, max_total_bytes: int) -> None:
        self.max_total_bytes = max_total_bytes
        self._buffers: dict[str, tuple[bytearray, torch.dtype, list[int]]] = {}
        self._received: dict[str, int] = {}
        self.total_bytes = 0

    def add(self, chunk: common_pb2.TensorChunk) -> None:
        if chunk.name not in self._buffers:
            if chunk.offset_bytes != 0 or chunk.dtype not in _DTYPES:
                raise InvalidRequest(f"tensor {chunk.name!r} must start with a header chunk")
            itemsize = torch.empty((), dtype=_DTYPES[chunk.dtype]).element_size()
            numel = 1
            for d in chunk.shape:
                if d < 0:
                    raise InvalidRequest(f"tensor {chunk.name!r} has a negative dimension")
                numel *= d
            if numel * itemsize != chunk.total_bytes:
                raise InvalidRequest(f"tensor {chunk.name!r}: shape and total_bytes disagree")
            self.total_bytes += chunk.total_bytes
            if self.total_bytes > self.max_total_bytes:
                raise ResourceExhausted(
                    f"tensors exceed this server's transfer limit of {self.max_total_bytes} bytes; "
                    "send fewer frames or enable token dropping"
                )
            self._buffers[chunk.name] = (bytearray(chunk.total_bytes), _DTYPES[chunk.dtype], list(chunk.shape))
            self._received[chunk.name] = 0
        buf, _, _ = self._buffers[chunk.name]
        end = chunk.offset_bytes + len(chunk.data)
        if chunk.offset_bytes != self._received[chunk.name] or end > len(buf):
            raise InvalidRequest(f"tensor {chunk.name!r}: chunk at offset {chunk.offset_bytes} is out of order")
        buf[chunk.offset_bytes : end] = chunk.data
        self._received[chunk.name] = end

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (buf, dtype, shape) in self._buffers.items():
            if self._received[name] != len(buf):
                raise InvalidRequest(f"tensor {name!r} ended after {self._received[name]} of {len(buf)} bytes")
            if len(buf) == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
        return out


def assemble(chunks: Iterable[common_pb2.TensorChunk], max_total_bytes: int) -> dict[str, torch.Tensor]:
    asm = TensorAssembler(max_total_bytes)
    for c in chunks:
        asm.add(c)
    return asm.tensors()
