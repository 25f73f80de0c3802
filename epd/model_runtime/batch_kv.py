"""The decode batch's KV cache: preallocated slots with per-slot lengths, written in place.

Every attention layer keeps one key and one value buffer [rows, num_kv_heads, columns, head_dim].
Running request r owns row r (rows 0..B-1 are always the running ones, in order) and its first
`lengths[r]` columns; the rest of its row is free room up to the longest request's final length.

One decode step for the batch:
  * each row's new key/value is written at its own column `lengths[r]` (no concatenation: the
    buffers are not copied step by step, unlike DynamicCache's torch.cat);
  * attention reads the view [:B, :, :max(lengths) + 1] (no copy either) with a padding mask that
    hides each row's columns past its own new token (`attention_mask`, [B, max + 1]);
  * then every length grows by one (`advance`).
A request joins by copying its transferred cache into the next free row (buffers grow, with one
copy, when the batch needs more rows or columns than they have) and leaves by moving the last row
into its place, so the running rows stay contiguous and the step's view needs no gather. A row
that changes hands is zeroed past its new owner's length (`_clear_after`): masked columns still
enter the attention product, and an inf left by the last owner would make the new one's logits NaN.

Why slots and not paged blocks (docs/architecture.md "Decode core"): on the CPU, attention over
blocks means gathering them into one tensor every step, which costs as much memory traffic as the
attention itself; slots give the kernel a plain strided view. The price is padding: a row is as
long as the longest final length in the batch, which the memory budget counts (`KvMemory`).

Rotary embeddings are applied before a key is cached, so a row's position in the buffer does not
matter: each request's positions travel beside it (the decode engine passes them per row).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from epd.model_runtime.kv_cache import KvCache


class _SlotLayer(DynamicLayer):
    """One attention layer of the batch, as transformers' attention modules call it."""

    def __init__(self, owner: BatchKv, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states: [B, kv_heads, 1, head_dim], one new token per row."""
        return self.owner.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner.max_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_length + query_length, 0


class BatchKv:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.keys: list[torch.Tensor] = [self._empty(0, 0) for _ in range(num_layers)]
        self.values: list[torch.Tensor] = [self._empty(0, 0) for _ in range(num_layers)]
        self.lengths: list[int] = []  # valid columns of each running row
        self._write_at: tuple[torch.Tensor, torch.Tensor] | None = None
        """(rows, columns) where this step's new tokens go: computed once per step, not per layer."""
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(num_layers)])

    # -- rows ---------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def max_length(self) -> int:
        return max(self.lengths, default=0)

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) every buffer holds now. The smallest, not the first layer's: a rebuild
        that failed part way (out of memory) leaves the first layers larger than the rest, and the
        next join must rebuild them all rather than write past the smaller ones."""
        buffers = (*self.keys, *self.values)
        return min(int(t.shape[0]) for t in buffers), min(int(t.shape[2]) for t in buffers)

    @property
    def num_bytes(self) -> int:
        """Bytes the buffers take (the padding included)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def add(self, kv: KvCache, columns: int) -> int:
        """Copy a request's cache (layers of [1, kv_heads, L, head_dim]) into a new last row;
        returns its row. `columns`: the longest final length of the batch with it (the room every
        row needs until its last token). When the buffers are too small they are rebuilt at
        exactly (rows, columns), never more: the memory budget priced exactly that."""
        if kv.num_layers != self.num_layers:
            raise ValueError(f"the KV cache has {kv.num_layers} layers; this model has {self.num_layers}")
        length = kv.num_cached_tokens
        if columns < max(length, self.max_length) + 1:
            raise ValueError(
                f"{columns} columns leave no room after {max(length, self.max_length)} cached tokens"
            )
        row = self.num_rows
        rows, cols = self.capacity
        if row + 1 > rows or columns > cols:
            self._reallocate(row + 1, columns)
        for i in range(self.num_layers):
            self.keys[i][row, :, :length] = kv.keys[i][0].to(self.device, self.dtype)
            self.values[i][row, :, :length] = kv.values[i][0].to(self.device, self.dtype)
        self._clear_after(row, length)
        self.lengths.append(length)
        self._write_at = None
        return row

    def remove(self, row: int) -> int | None:
        """Free `row`; the last row moves into its place. Returns the old index of the row that
        moved (None when `row` was the last). The buffers keep their size (the next request to
        join reuses the room) until the batch is empty, when they are freed."""
        last = self.num_rows - 1
        moved = None
        if row != last:
            n = self.lengths[last]
            for t in (*self.keys, *self.values):
                t[row, :, :n] = t[last, :, :n]
            self._clear_after(row, n)
            self.lengths[row] = n
            moved = last
        self.lengths.pop()
        self._write_at = None
        if not self.lengths:
            self._reallocate(0, 0, keep=False)  # an idle decoder holds no KV memory
        return moved

    # -- one step -----------------------------------------------------------------------------

    def attention_mask(self) -> torch.Tensor:
        """[B, max + 1] long: row r sees columns 0..lengths[r] (its cache and its new token)."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        columns = torch.arange(self.max_length + 1, device=self.device)
        return (columns[None, :] <= lengths[:, None]).long()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.num_rows
        if key.shape[0] != b or key.shape[2] != 1:
            raise ValueError(f"a decode step writes one token for each of {b} rows, got {tuple(key.shape)}")
        if self._write_at is None:
            self._write_at = (
                torch.arange(b, device=self.device),
                torch.tensor(self.lengths, dtype=torch.long, device=self.device),
            )
        rows, cols = self._write_at
        k, v = self.keys[layer], self.values[layer]
        if self.max_length + 1 > k.shape[2]:
            raise RuntimeError("a row outgrew the room reserved for it")
        k[rows, :, cols] = key[:, :, 0].to(k.dtype)
        v[rows, :, cols] = value[:, :, 0].to(v.dtype)
        end = self.max_length + 1
        return k[:b, :, :end], v[:b, :, :end]

    def advance(self) -> None:
        """After a forward pass: every row holds one more token."""
        self.lengths = [n + 1 for n in self.lengths]
        self._write_at = None

    def row_cache(self, row: int) -> KvCache:
        """A copy of one row's cache as it crosses boundaries (tests, debugging)."""
        n = self.lengths[row]
        return KvCache(
            [k[row : row + 1, :, :n].clone() for k in self.keys],
            [v[row : row + 1, :, :n].clone() for v in self.values],
        )

    # -- buffers ------------------------------------------------------------------------------

    def _clear_after(self, row: int, length: int) -> None:
        """Zeros in `row`'s columns from `length` on, which held the keys and values of the request
        that had the row before. They are masked, but a masked column still goes through the
        attention product (weight 0): an inf or NaN left there (a request whose cache overflowed)
        would make the new owner's logits NaN."""
        for t in (*self.keys, *self.values):
            t[row, :, length:] = 0

    def _empty(self, rows: int, cols: int) -> torch.Tensor:
        return torch.zeros(rows, self.num_kv_heads, cols, self.head_dim, dtype=self.dtype, device=self.device)

    def _reallocate(self, rows: int, cols: int, keep: bool = True) -> None:
        """New buffers of exactly (rows, cols), the running rows copied in (unless `keep` is
        False). Exact, not doubled: the memory budget counts these bytes (zeros, because a masked
        column still goes through the attention product and must not hold NaN)."""
        b, n = self.num_rows, self.max_length
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = self._empty(rows, cols)
                if keep and b and n:
                    new[:b, :, :n] = old[:b, :, :n]
                store[i] = new
