import pytest
import torch

from epd.token_pruning.attention_scores import received_attention
from epd.token_pruning.budget import kv_bytes_per_position
from epd.token_pruning.kv_compress import cache_bytes, compress_kv_cache, text_prior_scores


def _cache(layers=3, kv_heads=2, seq=30, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, kv_heads, seq, dim, generator=g), torch.randn(1, kv_heads, seq, dim, generator=g))
        for _ in range(layers)
    ]


VISUAL = torch.arange(4, 24)  # 4 text, 20 visual, 6 question entries


def _scores(layers=3, kv_heads=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(kv_heads, VISUAL.numel(), generator=g) for _ in range(layers)]


@pytest.mark.parametrize("merge", ["none", "averaged", "pivotal", "weighted"])
def test_budget_by_ratio_is_exact_and_text_is_kept(merge):
    caches, scores = _cache(), _scores()
    out = compress_kv_cache(caches, scores, VISUAL, keep_ratio=0.25, merge=merge)
    assert out.num_visual_kept == 5
    for layer, ((k, v), pos) in enumerate(zip(out.caches, out.kept_positions, strict=True)):
        assert k.shape == v.shape == (1, 2, 10 + 5, 8)
        for head in range(2):
            kept_visual = [p for p in pos[head].tolist() if 4 <= p < 24]
            expected = VISUAL[torch.topk(scores[layer][head], 5).indices].sort().values.tolist()
            assert kept_visual == expected
            # Text entries are untouched, whatever the merge mode.
            text_at = [i for i, p in enumerate(pos[head].tolist()) if not 4 <= p < 24]
            torch.testing.assert_close(
                k[0, head, text_at], caches[layer][0][0, head, [*range(4), *range(24, 30)]]
            )
    assert out.bytes_after * 30 == out.bytes_before * 15


def test_budget_by_bytes_is_the_largest_that_fits():
    caches, scores = _cache(), _scores()
    per_position = kv_bytes_per_position(3, 2, 8, 4)
    budget = per_position * 17 + per_position // 2  # room for 10 text + 7.5 visual positions
    out = compress_kv_cache(caches, scores, VISUAL, budget_bytes=budget)
    assert out.num_visual_kept == 7
    assert out.bytes_after == per_position * 17 <= budget
    assert cache_bytes(out.caches) == out.bytes_after
    with pytest.raises(ValueError, match="raise it to at least 3840"):
        compress_kv_cache(caches, scores, VISUAL, budget_bytes=100)


def test_budget_by_bytes_counts_the_bytes_of_the_dtype_sent():
    """A float32 cache sent as bfloat16 (`kv_dtype`): the budget counts 2-byte elements."""
    caches, scores = _cache(), _scores()
    sent_per_position = kv_bytes_per_position(3, 2, 8, 2)
    budget = sent_per_position * 17 + sent_per_position // 2  # room for 10 text + 7.5 visual positions, sent
    out = compress_kv_cache(caches, scores, VISUAL, budget_bytes=budget, sent_element_bytes=2)
    assert out.num_visual_kept == 7
    assert out.caches[0][0].dtype == torch.float32  # the cast to the sent dtype is the caller's
    assert cache_bytes(out.caches) // 2 == sent_per_position * 17 <= budget


def test_averaged_merge_preserves_total_weight():
    caches, scores = _cache(), _scores()
    out = compress_kv_cache(caches, scores, VISUAL, keep_ratio=0.3, merge="averaged")
    for (k, v), sizes, (k0, v0) in zip(out.caches, out.sizes, caches, strict=True):
        torch.testing.assert_close(sizes.sum(dim=1), torch.full((2,), 30.0))
        torch.testing.assert_close((k[0] * sizes[..., None]).sum(1), k0[0].sum(1))
        torch.testing.assert_close((v[0] * sizes[..., None]).sum(1), v0[0].sum(1))


def test_evicted_entries_fold_into_their_most_similar_kept_entry():
    # One head, 4 visual entries: keep 0 and 1; 2 is a near copy of 0, 3 of 1 (scaled).
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.0, 3.0]])[None, None]
    values = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [5.0, 5.0]])[None, None]
    scores = [torch.tensor([[0.9, 0.8, 0.1, 0.2]])]
    visual = torch.arange(4)
    avg = compress_kv_cache([(keys, values)], scores, visual, keep_ratio=0.5, merge="averaged")
    torch.testing.assert_close(avg.caches[0][1][0, 0], torch.tensor([[2.0, 2.0], [3.5, 3.5]]))
    torch.testing.assert_close(avg.caches[0][0][0, 0, 1], torch.tensor([0.0, 2.0]))
    piv = compress_kv_cache([(keys, values)], scores, visual, keep_ratio=0.5, merge="pivotal")
    torch.testing.assert_close(piv.caches[0][1][0, 0], torch.tensor([[2.0, 2.0], [3.5, 3.5]]))
    w = compress_kv_cache([(keys, values)], scores, visual, keep_ratio=0.5, merge="weighted")
    cos = 0.9 / (0.81 + 0.01) ** 0.5
    torch.testing.assert_close(w.caches[0][1][0, 0, 0], torch.full((2,), (1 + 3 * cos) / (1 + cos)))
    none = compress_kv_cache([(keys, values)], scores, visual, keep_ratio=0.5, merge="none")
    torch.testing.assert_close(none.caches[0][1][0, 0], values[0, 0, :2])


def test_pivotal_differs_from_averaged_when_several_fold_in():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.8, 0.2]])[None, None]
    values = torch.tensor([[0.0], [9.0], [3.0], [6.0]])[None, None]
    scores = [torch.tensor([[0.9, 0.8, 0.1, 0.2]])]
    avg = compress_kv_cache([(keys, values)], scores, torch.arange(4), keep_ratio=0.5, merge="averaged")
    piv = compress_kv_cache([(keys, values)], scores, torch.arange(4), keep_ratio=0.5, merge="pivotal")
    assert avg.caches[0][1][0, 0, 0].item() == pytest.approx(3.0)  # (0 + 3 + 6) / 3
    assert piv.caches[0][1][0, 0, 0].item() == pytest.approx(2.25)  # (0 + 4.5) / 2


def test_key_tokens_are_never_evicted():
    caches, scores = _cache(), _scores()
    key = torch.zeros(20, dtype=torch.bool)
    key[[0, 7]] = True
    for s in scores:
        s[:, [0, 7]] = -1.0  # the lowest scores of all
    out = compress_kv_cache(caches, scores, VISUAL, keep_ratio=0.1, key_mask=key)
    for pos in out.kept_positions:
        for head in pos:
            assert {4, 11} <= set(head.tolist())
    with pytest.raises(ValueError, match="2 key tokens exceed the KV budget of 1"):
        compress_kv_cache(caches, scores, VISUAL, keep_ratio=0.05, key_mask=key)


def test_text_prior_scores_average_each_kv_group():
    caches = _cache(layers=2, kv_heads=2, seq=30)
    g = torch.Generator().manual_seed(5)
    queries = [torch.randn(1, 4, 6, 8, generator=g) for _ in range(2)]
    qpos = torch.arange(24, 30)
    scores = text_prior_scores(queries, caches, qpos, VISUAL)
    for layer in range(2):
        per_head = [
            received_attention(queries[layer][:, [h]], caches[layer][0][:, [h // 2]], qpos, VISUAL).total[0]
            for h in range(4)
        ]
        torch.testing.assert_close(scores[layer][0], (per_head[0] + per_head[1]) / 2)
        torch.testing.assert_close(scores[layer][1], (per_head[2] + per_head[3]) / 2)
