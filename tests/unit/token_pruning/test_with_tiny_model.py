"""The pruning functions against a real (tiny, random) Qwen2-VL language model."""

import pytest
import torch

from epd.token_pruning.attention_scores import received_attention
from epd.token_pruning.positions import gather_prompt, visual_positions
from epd.token_pruning.query_capture import QueryCapture
from epd.token_pruning.text_guided import text_guided_drop, text_query_positions

VIDEO_ID = 60


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    text = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        video_token_id=VIDEO_ID,
        image_token_id=63,
        vision_start_token_id=61,
        vision_end_token_id=62,
    )
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Qwen2VLModel(config).eval()


@pytest.fixture(scope="module")
def prompt(model):
    """input_ids [1, L], inputs_embeds [1, L, 64], position_ids [4, 1, L] for a 2x4x6 video."""
    grid = torch.tensor([[2, 4, 6]])  # 2 * 2 * 3 = 12 merged tokens
    ids = [1, 2, 3, 4, 61] + [VIDEO_ID] * 12 + [62] + [5, 6, 7, 8, 9, 10]
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == VIDEO_ID).int() * 2
    rope, _ = model.get_rope_index(input_ids, mm_types, video_grid_thw=grid)
    position_ids = torch.cat([torch.arange(len(ids)).view(1, 1, -1), rope])
    g = torch.Generator().manual_seed(1)
    embeds = model.get_input_embeddings()(input_ids).detach().clone()
    embeds[input_ids == VIDEO_ID] = torch.randn(12, 64, generator=g)  # stand-in vision features
    return input_ids, embeds, position_ids


@torch.no_grad()
def test_pruned_prompt_equals_full_prompt_with_dropped_tokens_masked(model, prompt):
    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    seq = input_ids.shape[1]
    visual = visual_positions(input_ids, VIDEO_ID)
    keep_visual = torch.tensor([0, 3, 4, 9, 11])
    keep = torch.cat([torch.arange(5), visual[keep_visual], torch.arange(17, seq)]).sort().values
    pruned = gather_prompt(input_ids, position_ids, keep)
    # Reference: the full prompt, nobody may attend to a dropped token.
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    dropped = torch.ones(seq, dtype=torch.bool)
    dropped[keep] = False
    allowed[:, dropped] = False
    allowed[dropped, dropped] = True  # dropped rows only see themselves (outputs ignored)
    mask = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]
    full = lm(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask, use_cache=False)
    expected = full.last_hidden_state[:, keep]

    ones = pruned.attention_mask
    out = lm(
        inputs_embeds=embeds[:, keep], position_ids=pruned.position_ids, attention_mask=ones, use_cache=False
    )
    torch.testing.assert_close(out.last_hidden_state, expected, atol=1e-5, rtol=1e-5)

    # Renumbering the survivors 0..L'-1 (instead of keeping positions) gives other outputs.
    renumbered = torch.arange(keep.numel()).view(1, 1, -1).expand(4, 1, -1)
    wrong = lm(inputs_embeds=embeds[:, keep], position_ids=renumbered, attention_mask=ones, use_cache=False)
    assert not torch.allclose(wrong.last_hidden_state, expected, atol=1e-3)
    # Pitfall: gapped row-0 positions without an attention mask and without a cache make
    # transformers treat the gaps as packed-sequence boundaries. Always pass the mask.
    packed = lm(inputs_embeds=embeds[:, keep], position_ids=pruned.position_ids, use_cache=False)
    assert not torch.allclose(packed.last_hidden_state, expected, atol=1e-3)


@torch.no_grad()
def test_captured_queries_score_exactly_the_models_attention(model, prompt):
    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    visual = visual_positions(input_ids, VIDEO_ID)
    qpos = text_query_positions(input_ids.shape[1], visual)
    with QueryCapture(lm.layers, layers=[1, 2], query_index=qpos) as cap:
        out = lm(inputs_embeds=embeds, position_ids=position_ids, output_attentions=True, use_cache=False)
    for layer in (1, 2):
        weights = out.attentions[layer][0][:, qpos][..., visual]  # [heads, Q, V] from the model
        scores = received_attention(cap.queries[layer], cap.keys[layer], qpos, scored_keys=visual)
        torch.testing.assert_close(scores.total, weights.sum(1).view(2, 2, -1).mean(1), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(scores.max, weights.amax(1).view(2, 2, -1).amax(1), atol=1e-5, rtol=1e-4)

    result = text_guided_drop(cap.queries[1], cap.keys[1], qpos, visual, keep_ratio=0.25)
    assert result.kept_visual.numel() == 3
    assert result.keep_indices.numel() == input_ids.shape[1] - 9


def _reference_with_masks(lm, embeds, position_ids, drop_layer, dropped):
    """Full-length forward where layers >= drop_layer may not attend to `dropped` tokens
    (drop_layer and dropped may be lists, one entry per stage: later stages add to the set)."""
    from transformers import DynamicCache

    stages = list(zip(drop_layer, dropped)) if isinstance(drop_layer, list) else [(drop_layer, dropped)]
    seq = embeds.shape[1]
    cos, sin = lm.rotary_emb(embeds, position_ids[1:])
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    def blocked_by(gone):
        allowed = causal.clone()
        allowed[:, gone] = False
        allowed[gone, gone] = True
        return allowed

    to_mask = lambda allowed: torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))[None, None]  # noqa: E731
    cache = DynamicCache(config=lm.config)
    hidden = embeds
    for i, layer in enumerate(lm.layers):
        gone = torch.zeros(seq, dtype=torch.bool)
        for start, mask_here in stages:
            if i >= start:
                gone |= mask_here
        mask = to_mask(blocked_by(gone))
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_embeddings=(cos, sin),
            position_ids=position_ids[0],
            past_key_values=cache,
            use_cache=True,
        )
    return lm.norm(hidden), cache


@torch.no_grad()
def test_layerwise_prefill_without_drop_equals_the_model(model, prompt):
    from epd.token_pruning.layerwise_prefill import prefill_with_drop

    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    visual = visual_positions(input_ids, VIDEO_ID)
    full = lm(inputs_embeds=embeds, position_ids=position_ids, use_cache=True)
    out = prefill_with_drop(lm, embeds, position_ids, visual, drop_layer=None)
    torch.testing.assert_close(out.last_hidden_state, full.last_hidden_state)
    for mine, theirs in zip(out.past_key_values.layers, full.past_key_values.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys)
    assert out.tokens_per_layer == [input_ids.shape[1]] * 3


@torch.no_grad()
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_layerwise_prefill_drop_equals_masking_the_dropped_tokens(model, prompt, attn):
    from epd.token_pruning.layerwise_prefill import prefill_with_drop

    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    seq = input_ids.shape[1]
    visual = visual_positions(input_ids, VIDEO_ID)
    key = torch.zeros(12, dtype=torch.bool)
    key[5] = True
    lm.config._attn_implementation = attn
    try:
        out = prefill_with_drop(lm, embeds, position_ids, visual, 1, keep_ratio=0.25, key_mask=key)
    finally:
        lm.config._attn_implementation = "eager"
    assert out.drop is not None and out.drop.kept_visual.numel() == 3 and 5 in out.drop.kept_visual.tolist()
    keep = out.keep_indices
    assert keep.numel() == seq - 9 and out.tokens_per_layer == [seq, seq - 9, seq - 9]
    assert torch.equal(out.position_ids, position_ids[..., keep])
    dropped = torch.ones(seq, dtype=torch.bool)
    dropped[keep] = False
    ref_hidden, ref_cache = _reference_with_masks(lm, embeds, position_ids, 1, dropped)
    torch.testing.assert_close(out.last_hidden_state, ref_hidden[:, keep], atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(out.past_key_values.layers, ref_cache.layers, strict=True):
        assert mine.keys.shape[2] == keep.numel()
        torch.testing.assert_close(mine.keys, theirs.keys[:, :, keep], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values[:, :, keep], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_staged_drop_at_two_layers_equals_masking_each_stage(model, prompt):
    """Layers (1, 2), 25% kept: 12 visual -> 6 after layer 1 -> 3 after layer 2, the key token
    always among them; every layer equals the full model with the dropped tokens masked."""
    from epd.token_pruning.layerwise_prefill import prefill_with_drop

    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    seq = input_ids.shape[1]
    visual = visual_positions(input_ids, VIDEO_ID)
    key = torch.zeros(12, dtype=torch.bool)
    key[7] = True
    one = prefill_with_drop(lm, embeds, position_ids, visual, 1, keep_ratio=0.5, key_mask=key)
    out = prefill_with_drop(lm, embeds, position_ids, visual, [1, 2], keep_ratio=0.25, key_mask=key)
    assert out.visual_per_stage == [6, 3]
    assert out.tokens_per_layer == [seq, seq - 6, seq - 9]
    # Stage 1 is the single drop at layer 1 to 6 tokens; stage 2 keeps 3 of those 6.
    after_first = one.keep_indices
    assert set(out.keep_indices.tolist()) <= set(after_first.tolist())
    assert visual[7].item() in out.keep_indices.tolist()
    first = torch.ones(seq, dtype=torch.bool)
    first[after_first] = False
    second = torch.ones(seq, dtype=torch.bool)
    second[out.keep_indices] = False
    ref_hidden, ref_cache = _reference_with_masks(lm, embeds, position_ids, [1, 2], [first, second & ~first])
    keep = out.keep_indices
    torch.testing.assert_close(out.last_hidden_state, ref_hidden[:, keep], atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(out.past_key_values.layers, ref_cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys[:, :, keep], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="ascending"):
        prefill_with_drop(lm, embeds, position_ids, visual, [2, 1], keep_ratio=0.25)


@torch.no_grad()
def test_compressed_cache_decodes_and_full_budget_changes_nothing(model, prompt):
    from transformers import DynamicCache

    from epd.token_pruning.kv_compress import compress_kv_cache, text_prior_scores

    input_ids, embeds, position_ids = prompt
    lm = model.language_model
    seq = input_ids.shape[1]
    visual = visual_positions(input_ids, VIDEO_ID)
    qpos = text_query_positions(seq, visual)
    with QueryCapture(lm.layers, layers=range(3), query_index=qpos) as cap:
        prefill = lm(inputs_embeds=embeds, position_ids=position_ids, use_cache=True)
    caches = [(layer.keys, layer.values) for layer in prefill.past_key_values.layers]
    scores = text_prior_scores([cap.queries[i] for i in range(3)], caches, qpos, visual)
    new_token = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(2))
    next_pos = (position_ids[..., -1:] + 1).clone()

    def decode(layer_caches):
        cache = DynamicCache(ddp_cache_data=layer_caches, config=lm.config)
        n = layer_caches[0][0].shape[2]
        mask = torch.ones(1, n + 1, dtype=torch.long)
        return lm(inputs_embeds=new_token, position_ids=next_pos, attention_mask=mask, past_key_values=cache)

    reference = decode(caches).last_hidden_state
    full = compress_kv_cache(caches, scores, visual, keep_ratio=1.0, merge="averaged")
    torch.testing.assert_close(decode(full.caches).last_hidden_state, reference)
    small = compress_kv_cache(caches, scores, visual, keep_ratio=0.25, merge="averaged")
    assert small.bytes_after < full.bytes_after
    out = decode(small.caches).last_hidden_state
    assert out.shape == reference.shape and torch.isfinite(out).all()
