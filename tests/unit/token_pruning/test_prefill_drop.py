import pytest
import torch
from torch import nn

from epd.token_pruning.attention_scores import received_attention
from epd.token_pruning.positions import gather_prompt, prompt_keep_indices, visual_positions
from epd.token_pruning.text_guided import (
    dual_rule_select,
    text_guided_drop,
    text_query_positions,
)


def _qk(heads=6, kv_heads=2, seq=40, queries=5, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, queries, dim, generator=g) * 2
    k = torch.randn(1, kv_heads, seq, dim, generator=g) * 2
    return q, k, torch.arange(seq - queries, seq)


def test_gqa_scores_match_a_naive_loop():
    q, k, qpos = _qk()
    heads, kv_heads, seq = 6, 2, 40
    scored = torch.arange(3, 30)
    got = received_attention(q, k, qpos, scored_keys=scored, query_chunk=2)
    total = torch.zeros(kv_heads, seq)
    peak = torch.zeros(kv_heads, seq)
    for h in range(heads):
        g = h // (heads // kv_heads)  # transformers' repeat_kv: head h reads KV head h // n_rep
        for i, p in enumerate(qpos.tolist()):
            logits = (k[0, g, : p + 1] @ q[0, h, i]) / 8**0.5
            w = torch.softmax(logits, dim=0)
            total[g, : p + 1] += w / (heads // kv_heads)
            peak[g, : p + 1] = torch.maximum(peak[g, : p + 1], w)
    torch.testing.assert_close(got.total, total[:, scored])
    torch.testing.assert_close(got.max, peak[:, scored])


def test_scores_match_transformers_eager_attention_weights():
    from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

    q, k, qpos = _qk(seq=30, queries=30)  # every position a query: compare with the model's own
    module = nn.Module()
    module.num_key_value_groups = 3
    causal = torch.full((30, 30), float("-inf")).triu(1)[None, None]
    _, weights = eager_attention_forward(module, q, k, k, causal, scaling=8**-0.5)  # [1, 6, 30, 30]
    got = received_attention(q[:, :, -4:], k, qpos[-4:])
    expected = weights[0, :, -4:].sum(1).view(2, 3, 30).mean(1)
    torch.testing.assert_close(got.total, expected)


def test_dual_rule_drops_only_tokens_low_on_both():
    total = torch.tensor([0.9, 0.1, 0.1, 0.5, 0.05, 0.3])
    peak = torch.tensor([0.1, 0.9, 0.1, 0.5, 0.05, 0.3])
    # token 0 is high on total only, token 1 on max only: both survive a budget of 3;
    # token 3 is second on both and survives too; 2, 4, 5 go.
    assert dual_rule_select(total, peak, 3).tolist() == [0, 1, 3]
    assert dual_rule_select(total, peak, 4).tolist() == [0, 1, 3, 5]
    assert dual_rule_select(total, peak, 0).tolist() == []


def test_dual_rule_never_drops_a_token_that_beats_a_kept_one_on_both():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        total, peak = torch.rand(50, generator=g), torch.rand(50, generator=g)
        kept = dual_rule_select(total, peak, 17)
        assert kept.numel() == 17
        dropped = torch.ones(50, dtype=torch.bool)
        dropped[kept] = False
        dominates = (total[dropped][:, None] > total[kept][None]) & (
            peak[dropped][:, None] > peak[kept][None]
        )
        assert not dominates.any()


def test_key_tokens_are_never_dropped():
    total, peak = torch.rand(20), torch.rand(20)
    key = torch.zeros(20, dtype=torch.bool)
    lowest = torch.argsort(total + peak)[:3]
    key[lowest] = True
    kept = dual_rule_select(total, peak, 5, key)
    assert set(lowest.tolist()) <= set(kept.tolist()) and kept.numel() == 5
    with pytest.raises(ValueError, match="3 key tokens exceed the budget of 2"):
        dual_rule_select(total, peak, 2, key)


def test_text_guided_drop_meets_budget_and_keeps_positions():
    # Prompt: 4 text, 24 visual, 6 question tokens.
    video_id = 99
    input_ids = torch.tensor([[1, 2, 3, 4] + [video_id] * 24 + [5, 6, 7, 8, 9, 10]])
    visual = visual_positions(input_ids, video_id)
    q, k, _ = _qk(seq=34, queries=6)
    qpos = text_query_positions(34, visual)
    assert qpos.tolist() == list(range(28, 34))
    g = torch.Generator().manual_seed(1)
    position_ids = torch.randint(0, 50, (4, 1, 34), generator=g)
    for ratio, count, expected in ((0.25, None, 6), (0.5, None, 12), (1.0, 7, 7), (0.1, None, 3)):
        result = text_guided_drop(q, k, qpos, visual, keep_ratio=ratio, keep_count=count)
        assert result.kept_visual.numel() == expected
        assert result.keep_indices.numel() == 10 + expected
        pruned = gather_prompt(input_ids, position_ids, result.keep_indices)
        assert (pruned.input_ids == video_id).sum() == expected
        # Every survivor carries the position ids it had in the unpruned prompt.
        for new, old in enumerate(result.keep_indices.tolist()):
            assert torch.equal(pruned.position_ids[:, 0, new], position_ids[:, 0, old])
        assert pruned.input_ids[0, -6:].tolist() == [5, 6, 7, 8, 9, 10]


def test_prompt_keep_indices_and_errors():
    visual = torch.tensor([2, 3, 4, 5])
    assert prompt_keep_indices(8, visual, torch.tensor([False, True, False, True])).tolist() == [
        0,
        1,
        3,
        5,
        6,
        7,
    ]
    assert prompt_keep_indices(8, visual, torch.tensor([0, 2])).tolist() == [0, 1, 2, 4, 6, 7]
    with pytest.raises(ValueError, match="no text after the video"):
        text_query_positions(6, visual)
    with pytest.raises(ValueError, match=r"must be \[1, L\]"):
        visual_positions(torch.zeros(2, 3, dtype=torch.long), 0)


def test_kv_query_window_is_clamped_to_the_text_after_the_video():
    """100 prompt tokens, visual at [26, 73]: the KV scores' queries are text after the video only,
    so a window reaching into the video (60) scores with the same 26 tokens as no window."""
    visual = torch.arange(26, 74)
    assert text_query_positions(100, visual).tolist() == list(range(74, 100))
    assert text_query_positions(100, visual, window=10).tolist() == list(range(90, 100))
    assert text_query_positions(100, visual, window=26).tolist() == list(range(74, 100))
    assert text_query_positions(100, visual, window=60).tolist() == list(range(74, 100))
    # After a drop of 24 visual tokens every query sits 24 places earlier: still after the video.
    assert (text_query_positions(100, visual, window=60) - 24).min().item() == 74 - 24
    with pytest.raises(ValueError, match="no text after the video"):
        text_query_positions(74, visual, window=10)
