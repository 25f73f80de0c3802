import json

import pytest

from epd.token_pruning.accounting import (
    ModelSizes,
    PruningStats,
    layer_prefill_flops,
    prefill_flops,
    tokens_per_layer,
)
from epd.token_pruning.budget import keep_count_from_ratio, resolve_keep_count
from epd.token_pruning.config import PRESETS, PruningConfig


def test_default_is_all_off_and_presets_round_trip():
    assert not PruningConfig().any_enabled
    assert PRESETS["off"] == PruningConfig()
    for name, preset in PRESETS.items():
        wire = json.loads(json.dumps(preset.to_dict()))
        assert PruningConfig.from_dict(wire) == preset, name
    assert all(PRESETS[n].any_enabled for n in ("light", "balanced", "aggressive"))
    assert (
        PRESETS["aggressive"].prefill_keep_ratio
        < PRESETS["balanced"].prefill_keep_ratio
        < PRESETS["light"].prefill_keep_ratio
    )


def test_preset_overrides_and_validation_errors():
    cfg = PruningConfig.from_preset("balanced", kv_keep_ratio=0.3)
    assert cfg.kv_keep_ratio == 0.3 and cfg.prefill_keep_ratio == 0.5
    with pytest.raises(ValueError, match="unknown pruning preset 'fast'"):
        PruningConfig.from_preset("fast")
    with pytest.raises(ValueError, match=r"unknown pruning option\(s\) \['keep'\]"):
        PruningConfig.from_dict({"keep": 0.5})
    with pytest.raises(ValueError, match=r"kv_keep_ratio must be in \(0, 1\]"):
        PruningConfig(kv_keep_ratio=0.0)
    with pytest.raises(ValueError, match="kv_merge must be one of"):
        PruningConfig(kv_merge="mean")
    with pytest.raises(ValueError, match="prefill_keep_basis must be one of"):
        PruningConfig(prefill_keep_basis="prompt")


def test_prefill_keep_target_by_basis():
    from epd.prefill_svc.pruned_prefill import prefill_keep_target

    entering = PruningConfig(prefill_drop=True, prefill_keep_ratio=0.25)
    video = PruningConfig(prefill_drop=True, prefill_keep_ratio=0.25, prefill_keep_basis="video")
    # 200 video tokens, 120 left after the encode stages.
    assert prefill_keep_target(entering, 120, 200) == 30
    assert prefill_keep_target(video, 120, 200) == 50
    assert prefill_keep_target(video, 40, 200) == 40, "never more than enter"
    counted = PruningConfig(prefill_drop=True, prefill_keep_count=7, prefill_keep_basis="video")
    assert prefill_keep_target(counted, 120, 200) == 7, "an exact count wins over the ratio"
    assert PRESETS["budget25"].prefill_keep_basis == "video" and PRESETS["budget25"].kv_dtype == "bfloat16"
    with pytest.raises(ValueError, match="key_token_score must be one of"):
        PruningConfig.from_preset("light", key_token_score="cls")


def test_staged_prefill_drop_layers_validate_and_cross_the_wire():
    from epd.stages.errors import InvalidRequest
    from epd.transport.convert import pruning_from_proto, pruning_to_proto

    cfg = PruningConfig(prefill_drop=True, prefill_drop_layers=(1, 3), prefill_keep_ratio=0.25)
    assert cfg.drop_layers(num_layers=8) == (1, 3)
    assert cfg.drop_layers(num_layers=2) == (1,)  # clamped to the model's depth
    assert PruningConfig(prefill_drop=True, prefill_drop_layer=4).drop_layers(8) == (4,)
    assert PruningConfig(prefill_drop_layers=(1, 3)).drop_layers(8) == ()  # stage off
    assert PruningConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert pruning_from_proto(pruning_to_proto(cfg)) == cfg
    for name, preset in PRESETS.items():
        assert pruning_from_proto(pruning_to_proto(preset)) == preset, name
    for text in ("1,3", "[1, 3]", "(1, 3)"):
        msg = pruning_to_proto(PruningConfig(prefill_drop=True))
        msg.knobs["prefill_drop_layers"] = text
        assert pruning_from_proto(msg).prefill_drop_layers == (1, 3)
    with pytest.raises(ValueError, match="strictly ascending"):
        PruningConfig(prefill_drop_layers=(3, 1))
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        PruningConfig(kv_dtype="int4")
    assert PruningConfig(kv_dtype="bfloat16").any_enabled and not PruningConfig(kv_dtype="auto").any_enabled
    msg = pruning_to_proto(PruningConfig())
    msg.knobs["prefill_drop_layers"] = "one,two"
    with pytest.raises(InvalidRequest, match="prefill_drop_layers"):
        pruning_from_proto(msg)


def test_encode_cache_key_changes_only_with_encode_knobs():
    base = PruningConfig.from_preset("balanced")
    later_only = PruningConfig.from_preset("balanced", kv_keep_ratio=0.2, prefill_keep_ratio=0.1)
    assert base.encode_cache_key() == later_only.encode_cache_key()
    assert (
        base.encode_cache_key()
        != PruningConfig.from_preset("balanced", temporal_threshold=0.2).encode_cache_key()
    )
    # Knobs of a disabled stage do not split the cache.
    assert PruningConfig(temporal_threshold=0.2).encode_cache_key() == PruningConfig().encode_cache_key()


def test_keep_counts_are_exact():
    assert keep_count_from_ratio(10, 0.3) == 3  # not 4 from 0.30000000000000004 * 10
    assert keep_count_from_ratio(10, 0.25) == 3
    assert keep_count_from_ratio(7, 1.0) == 7 and keep_count_from_ratio(7, 0.0) == 0
    assert resolve_keep_count(10, 0.5, keep_count=20) == 10
    with pytest.raises(ValueError, match="keep ratio must be in"):
        keep_count_from_ratio(10, 1.5)


def test_prefill_flops_formula():
    sizes = ModelSizes(
        num_layers=2, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=2
    )
    # projections 2*3*4*(8+4) = 288, mlp 2*3*3*4*8 = 576, attention 2*4*3*4 = 96
    assert layer_prefill_flops(sizes, 3) == 288 + 576 + 96
    assert prefill_flops(sizes, 3) == 2 * (288 + 576 + 96)
    assert prefill_flops(sizes, [3, 0]) == 288 + 576 + 96
    assert tokens_per_layer(4, 100, 2, 30) == [100, 100, 30, 30]
    with pytest.raises(ValueError, match="3 token counts for 2 layers"):
        prefill_flops(sizes, [1, 2, 3])


def test_prefill_flops_count_head_dim_where_heads_times_head_dim_is_not_hidden():
    """Qwen3-VL-4B's text model: hidden 2560, 32 query heads and 8 KV heads of 128 (32 x 128 =
    4096, not 2560), MLP 9728, 36 layers; counted by hand over T = 1000 prompt tokens."""
    from transformers import Qwen3VLTextConfig

    from epd.model_runtime.adapter import TextDims

    dims = TextDims(
        num_layers=36, hidden_size=2560, intermediate_size=9728, num_heads=32, num_kv_heads=8, head_dim=128
    )
    text_config = Qwen3VLTextConfig(
        num_hidden_layers=36,
        hidden_size=2560,
        intermediate_size=9728,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    t = 1000
    q = 2 * t * 2560 * 4096  # q_proj [2560 -> 4096]
    o = 2 * t * 4096 * 2560  # o_proj [4096 -> 2560]
    k = v = 2 * t * 2560 * 1024  # k_proj, v_proj [2560 -> 8 x 128]
    mlp = 3 * 2 * t * 2560 * 9728  # gate, up [2560 -> 9728], down [9728 -> 2560]
    scores = values = 2 * 4096 * (t * (t + 1) // 2)  # QK^T and AV: every head's 128 over the causal half
    by_hand = q + o + k + v + mlp + scores + values
    for sizes in (ModelSizes.from_dims(dims), ModelSizes.from_config(text_config)):
        assert sizes.head_dim == 128
        assert layer_prefill_flops(sizes, t) == by_hand
        assert prefill_flops(sizes, t) == 36 * by_hand


def test_stats_record_and_serialise():
    sizes = ModelSizes(
        num_layers=4, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    )
    stats = PruningStats()
    stats.record("temporal", 400, 220)
    stats.record("prefill_drop", 220, 55)
    stats.prefill_flops_full = prefill_flops(sizes, 400 + 20)
    stats.prefill_flops_pruned = prefill_flops(sizes, tokens_per_layer(4, 220 + 20, 2, 55 + 20))
    out = json.loads(json.dumps(stats.to_dict()))
    assert out["stages"][1] == {
        "stage": "prefill_drop",
        "num_visual_tokens_in": 220,
        "num_visual_tokens_out": 55,
    }
    assert out["prefill_flops_saved"] == stats.prefill_flops_full - stats.prefill_flops_pruned > 0
    assert (stats.num_visual_tokens_in, stats.num_visual_tokens_out) == (400, 55)
