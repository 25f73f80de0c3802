"""Every pruning stage with the model's tensors on an accelerator (simulated: tests/simulated_device.py).

On a GPU the model's queries, keys, embeddings and caches are on the device while the prompt's
positions and the encode stage's grid are on the CPU; a work tensor made without `device=` and
combined with the model's raises "Expected all tensors to be on the same device". The simulated
device applies CUDA's rules to CPU values, so each stage here must run, give what it gives on the
CPU, and leave its results where the docstrings say: the model's numbers on the device, index
bookkeeping on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from epd.token_pruning.attention_scores import received_attention
from epd.token_pruning.config import PruningConfig
from epd.token_pruning.decode_policy import OutputAwareEviction
from epd.token_pruning.encode_stage import prune_encoded_tokens
from epd.token_pruning.grid import TokenGrid
from epd.token_pruning.kv_compress import compress_kv_cache, text_prior_scores
from epd.token_pruning.spatial_merge import spatial_merge
from epd.token_pruning.temporal import sparse_vision_inputs, temporal_redundancy_mask
from epd.token_pruning.text_guided import text_guided_drop
from tests.simulated_device import DEVICE, SimulatedDevice, is_on_device, move_module, on_cpu, on_device


def assert_on_device(t: torch.Tensor, values: torch.Tensor) -> None:
    assert is_on_device(t), f"expected a tensor on the device, got one on {t.device}"
    torch.testing.assert_close(on_cpu(t), values, rtol=0, atol=0)


def assert_on_cpu(t: torch.Tensor, values: torch.Tensor) -> None:
    assert not is_on_device(t), "expected a tensor on the CPU, got one on the device"
    torch.testing.assert_close(t, values, rtol=0, atol=0)


def test_the_simulated_device_refuses_what_cuda_refuses():
    """The harness itself: a CPU work tensor mixed with a device tensor raises; what CUDA allows runs."""
    with SimulatedDevice():
        x = on_device(torch.arange(6.0))
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(6)
        with pytest.raises(RuntimeError, match="same device"):
            torch.zeros(6)[on_device(torch.tensor([1]))] = 1.0  # a CPU tensor indexed by device indices
        with pytest.raises(RuntimeError, match="same device"):
            x[torch.tensor([1, 2])] = torch.ones(2)  # CPU values put into a device tensor
        assert is_on_device(torch.zeros(6, device=x.device) + x)
        assert is_on_device(x[torch.tensor([1, 2])]) and is_on_device(x * torch.tensor(2.0))
        assert not is_on_device(x.cpu()) and int(x.sum()) == 15


def _queries_keys(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 3, 8, generator=g)  # [1, heads, Q, D]
    k = torch.randn(1, 2, 12, 8, generator=g)  # [1, kv_heads, L, D]
    return q, k


def test_prefill_drop_scores_on_the_device_select_on_the_cpu():
    q, k = _queries_keys()
    visual, queries = torch.arange(2, 9), torch.tensor([9, 10, 11])  # prompt bookkeeping: CPU
    key_mask = torch.zeros(7, dtype=torch.bool)
    key_mask[5] = True
    scores = received_attention(q, k, queries, scored_keys=visual)
    drop = text_guided_drop(q, k, queries, visual, keep_ratio=0.5, key_mask=key_mask)
    with SimulatedDevice():
        scores_dev = received_attention(on_device(q), on_device(k), queries, scored_keys=visual)
        drop_dev = text_guided_drop(
            on_device(q), on_device(k), queries, visual, keep_ratio=0.5, key_mask=key_mask
        )
    assert_on_device(scores_dev.total, scores.total)
    assert_on_device(scores_dev.max, scores.max)
    for got, want in ((drop_dev.keep_indices, drop.keep_indices), (drop_dev.kept_visual, drop.kept_visual),
                      (drop_dev.total, drop.total)):  # fmt: skip
        assert_on_cpu(got, want)


@pytest.mark.parametrize("merge", ["none", "averaged", "pivotal", "weighted"])
def test_kv_compression_runs_on_the_caches_device(merge):
    g = torch.Generator().manual_seed(1)
    caches = [
        (torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)) for _ in range(2)
    ]
    queries = [torch.randn(1, 4, 3, 8, generator=g) for _ in range(2)]
    visual, query_positions = torch.arange(2, 9), torch.tensor([9, 10, 11])
    key_mask = torch.zeros(7, dtype=torch.bool)
    key_mask[0] = True
    scores = text_prior_scores(queries, caches, query_positions, visual)
    want = compress_kv_cache(caches, scores, visual, keep_ratio=0.5, merge=merge, key_mask=key_mask)
    with SimulatedDevice():
        caches_dev = [(on_device(k), on_device(v)) for k, v in caches]
        scores_dev = text_prior_scores([on_device(q) for q in queries], caches_dev, query_positions, visual)
        got = compress_kv_cache(
            caches_dev, scores_dev, visual, keep_ratio=0.5, merge=merge, key_mask=key_mask
        )
    for s_dev, s in zip(scores_dev, scores, strict=True):
        assert_on_device(s_dev, s)
    for (k_dev, v_dev), (k, v) in zip(got.caches, want.caches, strict=True):
        assert_on_device(k_dev, k)
        assert_on_device(v_dev, v)
    for pos_dev, pos in zip(got.kept_positions, want.kept_positions, strict=True):
        assert_on_device(pos_dev, pos)
    for size_dev, size in zip(got.sizes, want.sizes, strict=True):
        assert_on_device(size_dev, size)


def _similar_embeddings(grid: TokenGrid) -> torch.Tensor:
    """[N, 16]: two flat colours per frame group (so tokens merge) plus one odd token."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(2, 16, generator=g)
    _, rows, cols = grid.coords()
    emb = base[(cols >= grid.w // 2).long()] + 0.01 * torch.randn(grid.num_tokens, 16, generator=g)
    emb[3] = torch.randn(16, generator=g)
    return emb


def test_encode_stage_embeddings_stay_on_the_device_bookkeeping_on_the_cpu():
    grid = TokenGrid.full(2, 4, 4)
    emb = _similar_embeddings(grid)
    config = PruningConfig(spatial_merge=True, spatial_merge_threshold=0.9, key_token_ratio=0.1)
    present = torch.ones(32, dtype=torch.bool)
    present[20:24] = False  # temporal dropping removed four tokens (CPU: from the processor's pixels)
    merged = spatial_merge(emb, grid, 0.9)
    want = prune_encoded_tokens(emb[present], [(2, 8, 8)], present, config)
    with SimulatedDevice():
        merged_dev = spatial_merge(on_device(emb), grid, 0.9)
        got = prune_encoded_tokens(on_device(emb[present]), [(2, 8, 8)], present, config)
    assert merged.num_tokens_out < grid.num_tokens  # something merged
    assert_on_device(merged_dev.embeddings, merged.embeddings)
    for name in ("sizes", "representative", "assignment", "key_mask"):
        assert_on_cpu(getattr(merged_dev, name), getattr(merged, name))
    assert_on_device(got.embeddings, want.embeddings)
    assert int(want.key_mask.sum()) > 0
    for name in ("token_index", "sizes", "key_mask"):
        assert_on_cpu(getattr(got, name), getattr(want, name))


def test_temporal_drop_and_sparse_tower_inputs_on_the_pixels_device():
    g = torch.Generator().manual_seed(3)
    pixels = torch.randn(4 * 16, 12, generator=g)  # grid (4, 4, 4) in patches: 4 groups of 4 tokens
    pixels[16:32] = pixels[:16]  # group 1 repeats group 0
    mask = temporal_redundancy_mask(pixels, [(4, 4, 4)], threshold=0.05)
    sparse = sparse_vision_inputs(pixels, [(4, 4, 4)], mask.keep_tokens)
    with SimulatedDevice():
        mask_dev = temporal_redundancy_mask(on_device(pixels), [(4, 4, 4)], threshold=0.05)
        sparse_dev = sparse_vision_inputs(on_device(pixels), [(4, 4, 4)], mask_dev.keep_tokens)
        sparse_mixed = sparse_vision_inputs(on_device(pixels), [(4, 4, 4)], mask.keep_tokens)
    assert mask.num_tokens_out == 12
    assert_on_device(mask_dev.keep_tokens, mask.keep_tokens)
    for name in ("pixel_values", "position_ids", "cu_seqlens"):
        assert_on_device(getattr(sparse_dev, name), getattr(sparse, name))
        assert_on_device(getattr(sparse_mixed, name), getattr(sparse, name))


def test_decode_eviction_state_and_cache_on_the_device():
    g = torch.Generator().manual_seed(4)
    visual = torch.zeros(2, 10, dtype=torch.bool)
    visual[:, 2:8] = True
    keys = [torch.randn(1, 2, 11, 8, generator=g) for _ in range(2)]
    queries = [torch.randn(1, 4, 1, 8, generator=g) for _ in range(2)]

    def run(move):
        policy = OutputAwareEviction.start([move(visual) for _ in range(2)], keep_count=3, min_steps=1)
        for layer in range(2):  # 11 entries: the generated token's own is appended as text
            policy.observe_queries(layer, move(queries[layer]), move(keys[layer]))
        policy.observe(0, move(torch.full((1, 4, 1, 11), 1 / 11)))
        policy.step()
        assert policy.should_evict()
        return [policy.evict(layer, move(keys[layer]), move(keys[layer])) for layer in range(2)], policy

    want, policy_cpu = run(lambda t: t)
    with SimulatedDevice():
        got, policy = run(on_device)
    for (k_dev, v_dev), (k, v) in zip(got, want, strict=True):
        assert_on_device(k_dev, k)
        assert_on_device(v_dev, v)
    for state, state_cpu in zip(policy.layers, policy_cpu.layers, strict=True):
        assert_on_device(state.ema, state_cpu.ema)
        assert_on_device(state.positions, state_cpu.positions)
    assert policy.num_evicted == 3


def test_a_cpu_policy_observes_device_attention():
    """The masks decide where the policy's state lives; attention from the device is moved to it."""
    policy = OutputAwareEviction.start([torch.ones(2, 4, dtype=torch.bool)], keep_count=2)
    with SimulatedDevice():
        policy.observe(0, on_device(torch.full((1, 4, 1, 4), 0.25)))
    assert not is_on_device(policy.layers[0].ema)
    torch.testing.assert_close(policy.layers[0].ema, torch.full((2, 4), 0.1 * 0.25))


@pytest.fixture(scope="module")
def adapters(tiny_models):
    """The tiny Qwen2-VL twice: on the CPU, and with every weight on the simulated device."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter

    config = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    cpu, device = load_adapter(config, "all"), load_adapter(config, "all")
    move_module(device.model)
    device.device = DEVICE
    return cpu, device


def _ask_pruned(adapter, video, pruning: PruningConfig, max_new_tokens: int):
    """The three stages' pruning on one request, in this thread: encode-stage pruning (the tower
    on the kept patches), the pruned prefill, decode with eviction. (tokens, prefill output, media)."""
    from epd.decode_svc.engine import DecodeEngine
    from epd.encoder_svc.pruning import encode_stage_pruning
    from epd.model_runtime.adapter import VisualMeta
    from epd.model_runtime.sampling import GenerationConfig
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.engine import PrefillEngine
    from epd.prefill_svc.whole_prefill import prefill_pruned_request
    from epd.stages.contracts import EncodedMedia
    from epd.stages.messages import question_messages
    from epd.token_pruning import PruningStats

    inputs = adapter.preprocess(video)
    stats = PruningStats()
    embeds, token_index, key_mask = encode_stage_pruning(
        adapter, None, inputs.pixel_values, inputs.grid_thw, pruning, stats
    )
    meta = VisualMeta("video", inputs.grid_thw, inputs.second_per_grid_t, int(embeds.shape[0]))
    media = EncodedMedia(embeds, meta, video.num_frames, [], 0.0, 0.0, token_index=token_index,
                         key_mask=key_mask, pruning=stats)  # fmt: skip
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    prefill = PrefillEngine(PrefillConfig(), adapter)
    out = prefill_pruned_request(
        prefill.adapter, prefill.render(question_messages("what moves?"), media, generation, pruning)
    )
    h = out.handle
    decoding = DecodeEngine(adapter).start(
        out.cache, h.first_token_id, h.next_position_ids, generation, h.visual_entry_mask, pruning
    )
    tokens = [decoding.first().token_ids[0]]
    while not decoding.done:
        tokens += decoding.step().token_ids
    return tokens, out, media, decoding


def test_balanced_preset_through_a_real_model_on_the_device(adapters, media_files):
    """Qwen2-VL's adapter with its weights on the device: every stage of the "balanced" preset
    (temporal before the tower, key tokens, spatial merge, prefill drop, KV compression, decode
    eviction) runs and answers what the CPU answers; the KV cache stays on the device, the
    bookkeeping that crosses to the next stage is on the CPU."""
    from tests.reference import decode_for_test

    cpu, device = adapters
    video = decode_for_test(media_files["mp4"], 8)
    pruning = PruningConfig.from_preset("balanced", decode_min_steps=2, decode_evict_interval=2)
    want, want_out, want_media, want_decoding = _ask_pruned(cpu, video, pruning, 8)
    with SimulatedDevice():
        got, out, media, decoding = _ask_pruned(device, video, pruning, 8)
        evicted = decoding.eviction.counts
    assert got == want
    assert [s.stage for s in want_media.pruning.stages] == ["temporal", "spatial_merge"]
    assert [s.stage for s in want_out.handle.pruning.stages][-2:] == ["prefill_drop", "kv_compress"]
    assert want_decoding.eviction.counts[1] < want_decoding.eviction.counts[0]  # something was evicted
    assert evicted == want_decoding.eviction.counts
    assert is_on_device(media.embeds) and is_on_device(out.cache.keys[0])
    assert_on_cpu(media.token_index, want_media.token_index)
    assert_on_cpu(media.key_mask, want_media.key_mask)
    assert_on_cpu(out.handle.visual_entry_mask, want_out.handle.visual_entry_mask)
