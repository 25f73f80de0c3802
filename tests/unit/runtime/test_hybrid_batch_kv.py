"""Qwen3.5's decode batch (`_HybridBatchKv`: attention slots plus every running row's linear-attention
states stacked) on a tiny Qwen3.5 text model built from its config: what `num_bytes` reports is the
memory the batch holds, after joins and after leaves, and a leaving request's states are freed."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.qwen3_5 import Qwen3_5Adapter
from tests.families import build_qwen3_5_checkpoint

NUM_TOKENS = (9, 5, 7)  # the cached tokens of the three requests
COLUMNS = 16


@pytest.fixture(scope="module")
def language(tmp_path_factory) -> Qwen3_5Adapter:
    checkpoint = build_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "m")
    return Qwen3_5Adapter(str(checkpoint), ModelConfig(), {"language"})  # decode's adapter


def _cache(language: Qwen3_5Adapter, num_tokens: int, seed: int) -> KvCache:
    """A request's cache as prefill hands it over: KV of the attention layers, states of the
    linear ones (random values: only their shapes and where they go matter here)."""
    g = torch.Generator().manual_seed(seed)
    _, heads, head_dim, dtype = language._kv_shape()  # noqa: SLF001 - the model's own KV shape
    conv_shape, recurrent_shape = language.linear_state_shapes

    def rand(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return KvCache(
        [rand(1, heads, num_tokens, head_dim) for _ in language.attention_layers],
        [rand(1, heads, num_tokens, head_dim) for _ in language.attention_layers],
        list(language.attention_layers),
        {i: rand(1, *conv_shape) for i in language.linear_layers},
        {i: rand(1, *recurrent_shape, dtype=torch.float32) for i in language.linear_layers},
    )


def _held_bytes(batch) -> int:
    """Bytes of every storage the batch's tensors keep alive (a view keeps its whole storage)."""
    tensors = [*batch.keys, *batch.values]
    for layer in batch.linear.values():
        tensors += [t for t in (layer.conv_states[0], layer.recurrent_states[0]) if t is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _linear_state_bytes(batch) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in batch.linear.values()
        for t in (layer.conv_states[0], layer.recurrent_states[0])
        if t is not None
    )


def test_num_bytes_is_what_the_batch_holds_after_requests_leave(language):
    """After a leave, the linear states were the view [:rows] of the old tensors: the leaving
    request's states stayed in memory until the next join, and `num_bytes` (counting the view)
    reported one request's states fewer than the batch held."""
    caches = [_cache(language, n, seed) for seed, n in enumerate(NUM_TOKENS)]
    batch = language.new_batch_kv()
    for cache in caches:
        batch.add(cache, COLUMNS)
    assert batch.num_bytes == _held_bytes(batch)
    assert _linear_state_bytes(batch) == 3 * language.linear_state_bytes

    assert batch.remove(0) == 2  # the last request moves into row 0
    assert batch.num_bytes == _held_bytes(batch)
    assert _held_bytes(batch) - _linear_state_bytes(batch) == sum(
        # no state storage beyond the rows'
        t.numel() * t.element_size()
        for t in (*batch.keys, *batch.values)
    )
    assert _linear_state_bytes(batch) == 2 * language.linear_state_bytes
    moved = batch.row_cache(0)  # row 0 is the third request's now
    for i in language.linear_layers:
        assert torch.equal(moved.conv_states[i], caches[2].conv_states[i])
        assert torch.equal(moved.recurrent_states[i], caches[2].recurrent_states[i])

    assert batch.remove(1) is None  # the last row leaves
    assert batch.num_bytes == _held_bytes(batch)
    assert _linear_state_bytes(batch) == language.linear_state_bytes
    # The model still steps the request that stays, on the states the batch holds now.
    positions = torch.full((4, 1), NUM_TOKENS[2], dtype=torch.long)
    logits = language.decode_batch([1], positions, batch)
    assert logits.shape[0] == 1 and bool(torch.isfinite(logits).all())
    # stepped in place
    assert not torch.equal(batch.row_cache(0).recurrent_states[0], caches[2].recurrent_states[0])

    batch.remove(0)
    assert batch.num_rows == 0 and batch.num_bytes == 0 == _held_bytes(batch)
