import pytest
import torch

from epd.token_pruning.grid import TokenGrid
from epd.token_pruning.key_tokens import key_token_scores, select_key_tokens
from epd.token_pruning.spatial_merge import spatial_merge


def _clustered(t=2, h=5, w=7, dim=16, seed=0):
    """Embeddings equal within 2x2 windows (plus tiny noise), unrelated across windows."""
    g = torch.Generator().manual_seed(seed)
    grid = TokenGrid.full(t, h, w)
    _, rows, cols = grid.coords()
    window_id = torch.arange(t).repeat_interleave(h * w) * 100 + (rows // 2) * 10 + cols // 2
    centres = torch.randn(1000, dim, generator=g)
    emb = centres[window_id] + 0.001 * torch.randn(grid.num_tokens, dim, generator=g)
    return emb, grid, window_id


def test_merge_preserves_total_weight():
    emb, grid, _ = _clustered()
    sizes = torch.rand(grid.num_tokens, generator=torch.Generator().manual_seed(1)) + 0.5
    out = spatial_merge(emb, grid, threshold=0.9, window=2, sizes=sizes)
    assert out.num_tokens_out < grid.num_tokens
    torch.testing.assert_close(out.sizes.sum(), sizes.sum())
    torch.testing.assert_close((out.embeddings * out.sizes[:, None]).sum(0), (emb * sizes[:, None]).sum(0))
    # Every input lands in exactly one output, and each output is its members' weighted mean.
    for j in range(out.num_tokens_out):
        members = out.assignment == j
        expected = (emb[members] * sizes[members, None]).sum(0) / sizes[members].sum()
        torch.testing.assert_close(out.embeddings[j], expected)


def test_merge_groups_are_the_windows_on_odd_grids():
    emb, grid, window_id = _clustered(h=5, w=7)
    out = spatial_merge(emb, grid, threshold=0.9, window=2)
    # 2 groups x ceil(5/2) x ceil(7/2) windows; edge windows are smaller.
    assert out.num_tokens_out == 2 * 3 * 4
    for j in range(out.num_tokens_out):
        assert window_id[out.assignment == j].unique().numel() == 1
    # Representatives are each group's first member: increasing, and they keep their cell.
    assert torch.equal(out.representative, torch.sort(out.representative).values)
    assert torch.equal(out.grid.flat_index, grid.flat_index[out.representative])
    assert sorted(out.sizes.tolist()) == sorted(
        torch.bincount(window_id)[torch.bincount(window_id) > 0].float().tolist()
    )


def test_merge_threshold_one_and_window_one_merge_nothing():
    emb, grid, _ = _clustered()
    for kwargs in ({"threshold": 1.0, "window": 2}, {"threshold": 0.5, "window": 1}):
        out = spatial_merge(emb, grid, **kwargs)
        assert out.num_tokens_out == grid.num_tokens
        torch.testing.assert_close(out.embeddings, emb)


def test_merge_never_merges_frames_together_or_key_tokens():
    emb = torch.ones(2 * 2 * 2, 4)  # all identical, 2 frame groups of 2x2
    grid = TokenGrid.full(2, 2, 2)
    key = torch.zeros(8, dtype=torch.bool)
    key[5] = True
    out = spatial_merge(emb, grid, threshold=0.5, window=4, key_mask=key)
    assert out.representative.tolist() == [0, 4, 5]
    assert out.sizes.tolist() == [4.0, 3.0, 1.0]
    assert out.key_mask.tolist() == [False, False, True]


def test_merge_on_sparse_grid_after_temporal_drop():
    emb, grid, _ = _clustered(t=2, h=4, w=4)
    present = torch.tensor([i for i in range(32) if i not in (1, 4, 17)])  # holes in both groups
    sub = grid.select(present)
    out = spatial_merge(emb[present], sub, threshold=0.9, window=2)
    cell = {int(c): i for i, c in enumerate(present)}
    # Cells 0 and 5 of group 0 are only diagonal now: not adjacent, so not merged.
    assert out.assignment[cell[0]] != out.assignment[cell[5]]
    # The full window next to them (cells 2, 3, 6, 7) still becomes one token.
    assert len({int(out.assignment[cell[c]]) for c in (2, 3, 6, 7)}) == 1
    torch.testing.assert_close(out.sizes.sum(), torch.tensor(29.0))


def test_key_tokens_distinct_score_picks_the_odd_one_out():
    grid = TokenGrid.full(2, 4, 4)
    emb = torch.ones(32, 8) + 0.01 * torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    emb[21] = -emb[21]  # one token unlike all its neighbours
    emb[6, :4] = -1.0  # one that differs partly
    scores = key_token_scores(emb, grid)
    assert scores.argmax() == 21
    mask = select_key_tokens(emb, grid, key_count=2)
    assert mask.nonzero().flatten().tolist() == [6, 21]
    assert select_key_tokens(emb, grid, key_ratio=0.25).sum() == 8
    assert not select_key_tokens(emb, grid).any()


def test_key_tokens_norm_score_and_errors():
    grid = TokenGrid.full(1, 2, 2)
    emb = torch.tensor([[1.0, 0], [3.0, 0], [2.0, 0], [0.5, 0]])
    assert select_key_tokens(emb, grid, key_count=2, score="norm").tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="'distinct' or 'norm'"):
        key_token_scores(emb, grid, score="cls")
    with pytest.raises(ValueError, match="3 embeddings for a grid of 4"):
        key_token_scores(emb[:3], grid)
