"""The decode batch's slots without a model: a row that changes hands holds nothing of the request
that had it before, past its own length. Those columns are masked, but a masked column still goes
through the attention product with weight 0, and 0 x inf is NaN."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.batch_kv import BatchKv
from epd.model_runtime.kv_cache import KvCache

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def _cache(length: int, fill: float) -> KvCache:
    shape = (1, HEADS, length, HEAD_DIM)
    return KvCache(
        [torch.full(shape, fill) for _ in range(LAYERS)], [torch.full(shape, fill) for _ in range(LAYERS)]
    )


def _step_view_is_finite(batch: BatchKv) -> bool:
    """What one decode step's attention reads: [:B, :, :max + 1] of every buffer."""
    end = batch.max_length + 1
    return all(bool(torch.isfinite(t[: batch.num_rows, :, :end]).all()) for t in (*batch.keys, *batch.values))


def test_a_row_moved_into_a_freed_one_leaves_nothing_of_its_last_owner():
    batch = BatchKv(LAYERS, HEADS, HEAD_DIM, torch.float32)
    columns = 40
    batch.add(_cache(30, 1.0), columns)  # the longest: the step reads 31 columns of every row
    overflowed = batch.add(_cache(20, float("inf")), columns)
    batch.add(_cache(10, 2.0), columns)
    assert batch.remove(overflowed) == 2  # the short row moves into the overflowed one's place
    assert batch.lengths == [30, 10]
    assert _step_view_is_finite(batch)


def test_a_row_joined_where_another_left_leaves_nothing_of_its_last_owner():
    batch = BatchKv(LAYERS, HEADS, HEAD_DIM, torch.float32)
    columns = 40
    batch.add(_cache(30, 1.0), columns)
    overflowed = batch.add(_cache(20, float("nan")), columns)
    assert batch.remove(overflowed) is None  # the last row: nothing moves, the buffers stay
    assert batch.add(_cache(10, 2.0), columns) == overflowed
    assert _step_view_is_finite(batch)


def test_after_a_rebuild_that_ran_out_of_memory_requests_still_join(monkeypatch):
    """The buffers are rebuilt layer by layer; out of memory part way, the first layers had grown and
    the rest had not. Only the joining request may fail: the next joins must not write past the
    smaller buffers (each one failed, until the batch emptied)."""
    batch = BatchKv(LAYERS, HEADS, HEAD_DIM, torch.float32)
    batch.add(_cache(5, 1.0), 10)
    empty = batch._empty
    calls = []

    def out_of_memory_at_the_third(rows: int, cols: int) -> torch.Tensor:
        calls.append((rows, cols))
        if len(calls) == 3:
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return empty(rows, cols)

    monkeypatch.setattr(batch, "_empty", out_of_memory_at_the_third)
    with pytest.raises(torch.OutOfMemoryError):
        batch.add(_cache(5, 2.0), 10)
    monkeypatch.setattr(batch, "_empty", empty)
    assert batch.lengths == [5]
    for _ in range(3):
        batch.add(_cache(4, 2.0), 10)
    assert batch.lengths == [5, 4, 4, 4]
    assert all(t.shape[0] >= 4 for t in (*batch.keys, *batch.values))
