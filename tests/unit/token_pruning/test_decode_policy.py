import pytest
import torch

from epd.token_pruning.decode_policy import OutputAwareEviction


def _weights(num_heads, n, hot, cold_value=1e-4):
    """[1, heads, 1, n]: the new token puts its attention on `hot` entries."""
    w = torch.full((1, num_heads, 1, n), cold_value)
    w[..., hot] = 1.0
    return w / w.sum(-1, keepdim=True)


def test_evicts_persistently_ignored_visual_entries_to_the_budget():
    # 2 layers, 2 KV heads, 4 query heads; 3 text + 10 visual entries after prefill.
    visual = torch.zeros(2, 13, dtype=torch.bool)
    visual[:, 3:] = True
    policy = OutputAwareEviction.start([visual, visual], keep_count=4, min_steps=3, evict_interval=2)
    caches = [(torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)) for _ in range(2)]
    hot = [4, 6, 9, 12]
    evicted_at = None
    for _ in range(6):
        n = caches[0][0].shape[2] + 1  # the new token's own entry is appended
        caches = [
            (torch.cat([k, torch.randn(1, 2, 1, 8)], 2), torch.cat([v, torch.randn(1, 2, 1, 8)], 2))
            for k, v in caches
        ]
        for layer in range(2):
            policy.observe(layer, _weights(4, n, hot))
        policy.step()
        if policy.should_evict():
            evicted_at = evicted_at or policy.num_steps
            originals = [k for k, _ in caches]  # before the first eviction, index == position
            caches = [policy.evict(layer, k, v) for layer, (k, v) in enumerate(caches)]
            for layer in range(2):
                for head in range(2):
                    rows = originals[layer][0, head, policy.layers[layer].positions[head]]
                    torch.testing.assert_close(caches[layer][0][0, head], rows)
            hot = policy.layers[0].visual[0].nonzero().flatten().tolist()  # cache indices moved
    assert evicted_at == 3
    assert policy.num_visual == 4 and policy.num_evicted == 6
    for layer in range(2):
        state = policy.layers[layer]
        assert state.positions[0, state.visual[0]].tolist() == [4, 6, 9, 12]
        assert caches[layer][0].shape[2] == 3 + 4 + 6  # text + kept visual + generated
        # Text and generated entries are never evicted.
        assert state.positions[0, ~state.visual[0]].tolist() == [0, 1, 2, 13, 14, 15, 16, 17, 18]


def test_no_eviction_before_min_steps_or_within_budget():
    visual = torch.ones(1, 6, dtype=torch.bool)
    policy = OutputAwareEviction.start([visual], keep_count=6, min_steps=1)
    policy.observe(0, _weights(1, 7, [0]))
    policy.step()
    assert not policy.should_evict()  # already within budget
    policy = OutputAwareEviction.start([visual], keep_count=2, min_steps=3)
    policy.observe(0, _weights(1, 7, [0]))
    policy.step()
    assert not policy.should_evict()


def test_observe_queries_groups_heads_like_observe():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    visual = torch.ones(2, 9, dtype=torch.bool)
    a = OutputAwareEviction.start([visual], keep_count=3, ema_decay=0.0)
    a.observe_queries(0, q, k)
    weights = torch.softmax(q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / 8**0.5, dim=-1)
    b = OutputAwareEviction.start([visual], keep_count=3, ema_decay=0.0)
    b.observe(0, weights)
    torch.testing.assert_close(a.layers[0].ema, b.layers[0].ema)
    torch.testing.assert_close(b.layers[0].ema[0], weights[0, :2, 0].mean(0))


def test_start_rejects_uneven_visual_counts():
    a = torch.tensor([[True, True, False]])
    b = torch.tensor([[True, False, False]])
    with pytest.raises(ValueError, match="same number of visual entries"):
        OutputAwareEviction.start([a, b], keep_count=1)
