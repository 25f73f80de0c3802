"""Token dropping and KV compression wired through the stages: off is exact, each stage on
shrinks what it should, and the report says so. Quality is measured in bench/, not here."""

from __future__ import annotations

import asyncio
import math

import grpc
import numpy as np
import pytest

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.token_pruning import PruningConfig
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from epd.video.types import SamplingOptions

QUESTION = "what colour is the square?"


@pytest.fixture(scope="module")
def pipeline(tiny_models):
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        yield pipeline


@pytest.fixture(scope="module")
def static_video(tmp_path_factory):
    """Every frame identical: temporal dropping should remove all but the first frame group."""
    import av

    path = tmp_path_factory.mktemp("static") / "static.mp4"
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, size=(84, 112, 3), dtype=np.uint8)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10, options={"qp": "0"})
        s.width, s.height, s.pix_fmt = 112, 84, "yuv444p"
        for _ in range(40):
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def ask(pipeline, path, pruning: PruningConfig, num_frames=8, max_new_tokens=10) -> AskSummary:
    req = AskRequest(
        question_messages(QUESTION),
        MediaInput(path.read_bytes()),
        SamplingOptions(num_frames=num_frames),
        GenerationConfig(max_new_tokens=max_new_tokens),
        pruning=pruning,
    )

    async def run():
        async for item in pipeline.ask(req):
            if isinstance(item, AskSummary):
                return item

    return asyncio.run(run())


def stages(summary: AskSummary) -> dict[str, tuple[int, int]]:
    return {s.stage: (s.num_visual_tokens_in, s.num_visual_tokens_out) for s in summary.pruning.stages}


def test_off_is_exact(pipeline, media_files):
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    again = ask(pipeline, media_files["mp4"], PruningConfig.from_preset("off"))
    assert again.token_ids == base.token_ids and stages(again) == {}
    assert again.kv_num_bytes == base.kv_num_bytes


def test_temporal_drop_static_vs_changing(pipeline, static_video, media_files):
    cfg = PruningConfig(temporal_drop=True, temporal_threshold=0.05)
    static = stages(ask(pipeline, static_video, cfg))["temporal"]
    per_group = static[0] // 4  # 8 frames = 4 temporal groups
    assert static[1] == per_group, "a static video keeps only its first frame group"
    noisy = stages(ask(pipeline, media_files["mp4_b"], cfg))["temporal"]
    assert noisy[1] == noisy[0], "a video whose every frame is new loses nothing"


def test_temporal_drop_after_tower_keeps_exact_embeddings_count(pipeline, static_video):
    cfg = PruningConfig(temporal_drop=True, temporal_before_tower=False)
    summary = ask(pipeline, static_video, cfg)
    full, kept = stages(summary)["temporal"]
    assert kept == full // 4 and summary.num_visual_tokens == kept
    assert len(summary.kept_visual_token_index) == kept


def test_prefill_drop_budget_and_cache_length(pipeline, media_files):
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    cfg = PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.25)
    s = ask(pipeline, media_files["mp4"], cfg)
    v = base.num_visual_tokens
    assert stages(s)["prefill_drop"] == (v, math.ceil(0.25 * v))
    kept = math.ceil(0.25 * v)
    assert s.kv_num_bytes == base.kv_num_bytes * (base.num_prompt_tokens - v + kept) // base.num_prompt_tokens
    assert s.pruning.prefill_flops_pruned < s.pruning.prefill_flops_full
    assert (
        len(s.kept_visual_token_index) == kept
        and sorted(set(s.kept_visual_token_index)) == s.kept_visual_token_index
    )


def test_staged_prefill_drop_through_the_services(pipeline, media_files):
    """Two drop layers: the final budget is the same as one drop's, but layer 0 already runs on
    fewer tokens, so the prefill is cheaper than dropping once at layer 1."""
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    once = ask(
        pipeline,
        media_files["mp4"],
        PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.25),
    )
    staged = ask(
        pipeline,
        media_files["mp4"],
        PruningConfig(prefill_drop=True, prefill_drop_layers=(0, 1), prefill_keep_ratio=0.25),
    )
    v = base.num_visual_tokens
    kept = math.ceil(0.25 * v)
    assert stages(staged)["prefill_drop"] == (v, kept)
    assert staged.kv_num_bytes == once.kv_num_bytes
    assert staged.pruning.prefill_flops_pruned < once.pruning.prefill_flops_pruned
    assert len(staged.kept_visual_token_index) == kept
    # KV compression on top scores each layer with the question's queries in that layer's own
    # (shrunk) sequence, and halves the visual entries that are left.
    both = ask(
        pipeline,
        media_files["mp4"],
        PruningConfig(
            prefill_drop=True,
            prefill_drop_layers=(0, 1),
            prefill_keep_ratio=0.25,
            kv_compress=True,
            kv_keep_ratio=0.5,
        ),
    )
    assert stages(both)["kv_compress"] == (kept, math.ceil(0.5 * kept))
    text = base.num_prompt_tokens - v
    assert both.kv_num_bytes == base.kv_num_bytes * (text + math.ceil(0.5 * kept)) // base.num_prompt_tokens


def test_video_basis_budget_counts_the_encode_stages(pipeline, static_video):
    """prefill_keep_basis="video": the ratio is of the video's tokens before the encode stages, so
    prefill drops only what temporal dropping (which keeps 1 group of 4 here) left above it."""
    temporal = dict(temporal_drop=True, prefill_drop=True, prefill_drop_layer=1)
    v = stages(ask(pipeline, static_video, PruningConfig(temporal_drop=True)))["temporal"][0]
    after_temporal = v // 4
    already_met = ask(
        pipeline, static_video, PruningConfig(**temporal, prefill_keep_ratio=0.5, prefill_keep_basis="video")
    )
    assert "prefill_drop" not in stages(already_met), "25% left is under the 50% budget: no drop"
    assert already_met.num_visual_tokens == after_temporal
    tighter = ask(
        pipeline,
        static_video,
        PruningConfig(**temporal, prefill_keep_ratio=0.125, prefill_keep_basis="video"),
    )
    assert stages(tighter)["prefill_drop"] == (after_temporal, math.ceil(0.125 * v))
    entering = ask(pipeline, static_video, PruningConfig(**temporal, prefill_keep_ratio=0.5))
    assert stages(entering)["prefill_drop"] == (after_temporal, math.ceil(0.5 * after_temporal))


def test_budget25_preset_keeps_at_most_a_quarter_at_half_the_kv_bytes(pipeline, media_files):
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    s = ask(pipeline, media_files["mp4"], PruningConfig.from_preset("budget25"))
    v = base.num_visual_tokens
    assert s.pruning.num_visual_tokens_in == v
    assert s.pruning.num_visual_tokens_out <= math.ceil(0.25 * v)
    text = base.num_prompt_tokens - v
    per_position = base.kv_num_bytes // base.num_prompt_tokens
    assert s.kv_num_bytes == (text + s.pruning.num_visual_tokens_out) * per_position // 2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_kv_dtype_halves_the_transferred_cache(pipeline, media_files, dtype):
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    s = ask(pipeline, media_files["mp4"], PruningConfig(kv_dtype=dtype))
    assert s.kv_num_bytes * 2 == base.kv_num_bytes
    assert s.pruning.kv_bytes_before == base.kv_num_bytes and s.pruning.kv_bytes_after == s.kv_num_bytes
    assert len(s.token_ids) == len(base.token_ids) and s.token_ids[0] == base.token_ids[0]
    # On top of a 25% prefill drop: text + a quarter of the visual entries, at half the bytes each.
    both = ask(
        pipeline,
        media_files["mp4"],
        PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.25, kv_dtype=dtype),
    )
    v, kept = base.num_visual_tokens, math.ceil(0.25 * base.num_visual_tokens)
    assert (
        both.kv_num_bytes * 2
        == base.kv_num_bytes * (base.num_prompt_tokens - v + kept) // base.num_prompt_tokens
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kv_budget_counts_the_bytes_sent_in_kv_dtype(pipeline, media_files, dtype):
    """kv_budget_bytes bounds what is sent; with a narrower kv_dtype an entry costs half the bytes
    (the cast comes after compression), so twice as many visual entries fit as in float32."""
    base = ask(pipeline, media_files["mp4"], PruningConfig())  # float32
    v = base.num_visual_tokens
    text = base.num_prompt_tokens - v
    sent_per_position = base.kv_num_bytes // base.num_prompt_tokens // 2
    budget = sent_per_position * (text + v // 2) + sent_per_position // 2  # text + v/2 + half an entry
    s = ask(
        pipeline, media_files["mp4"], PruningConfig(kv_compress=True, kv_budget_bytes=budget, kv_dtype=dtype)
    )
    assert stages(s)["kv_compress"] == (v, v // 2)  # counted in float32, the text alone was over budget
    assert s.kv_num_bytes == sent_per_position * (text + v // 2) <= budget
    budget = 2 * text * sent_per_position  # the text alone in float32: no visual entry fitted, counted so
    s = ask(
        pipeline, media_files["mp4"], PruningConfig(kv_compress=True, kv_budget_bytes=budget, kv_dtype=dtype)
    )
    kept = min(v, text)
    assert kept > 0 and stages(s)["kv_compress"] == (v, kept)
    assert s.kv_num_bytes == sent_per_position * (text + kept) <= budget


@pytest.mark.parametrize("merge", ["averaged", "pivotal", "weighted", "none"])
def test_kv_compression_shrinks_the_transferred_cache(pipeline, media_files, merge):
    base = ask(pipeline, media_files["mp4"], PruningConfig())
    cfg = PruningConfig(kv_compress=True, kv_keep_ratio=0.5, kv_merge=merge)
    s = ask(pipeline, media_files["mp4"], cfg)
    v = base.num_visual_tokens
    assert stages(s)["kv_compress"] == (v, math.ceil(0.5 * v))
    expected = base.kv_num_bytes * (base.num_prompt_tokens - v + math.ceil(0.5 * v)) // base.num_prompt_tokens
    assert s.kv_num_bytes == s.pruning.kv_bytes_after == expected
    assert s.pruning.kv_bytes_before == base.kv_num_bytes


def test_key_tokens_and_spatial_merge(pipeline, static_video):
    cfg = PruningConfig(spatial_merge=True, spatial_merge_threshold=-1.0, key_token_ratio=0.1)
    s = ask(pipeline, static_video, cfg)
    merged_in, merged_out = stages(s)["spatial_merge"]
    assert merged_out < merged_in and s.num_visual_tokens == merged_out
    assert s.pruning.num_key_tokens == math.ceil(0.1 * merged_in)


def test_decode_eviction_reports_counts(pipeline, media_files):
    cfg = PruningConfig(decode_evict=True, decode_keep_ratio=0.5, decode_min_steps=2, decode_evict_interval=2)
    s = ask(pipeline, media_files["mp4"], cfg, max_new_tokens=12)
    v = s.num_visual_tokens
    assert stages(s)["decode_evict"] == (v, math.ceil(0.5 * v))


def test_balanced_preset_through_three_services(shared_stack, media_files):
    """The preset travels through gateway -> encoder/prefill/decode; the KV sent shrinks."""
    data = media_files["mp4"].read_bytes()

    def ask_remote(stub, preset: str):
        header = gateway_pb2.AskHeader(
            question=QUESTION,
            media_num_bytes=len(data),
            sampling=common_pb2.VideoSampling(num_frames=8),
            generation=common_pb2.GenerationParams(max_new_tokens=10),
            pruning=common_pb2.PruningOptions(preset=preset, knobs={"prefill_drop_layer": "1"}),
        )
        reqs = [gateway_pb2.AskRequest(header=header), gateway_pb2.AskRequest(media_chunk=data)]
        return [m for m in stub.Ask(iter(reqs), timeout=120) if m.WhichOneof("kind") == "summary"][0].summary

    with grpc.insecure_channel(shared_stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        off = ask_remote(stub, "off")
        balanced = ask_remote(stub, "balanced")
        with pytest.raises(grpc.RpcError) as info:
            header = gateway_pb2.AskHeader(
                question=QUESTION,
                media_num_bytes=len(data),
                pruning=common_pb2.PruningOptions(preset="extreme"),
            )
            list(
                stub.Ask(
                    iter([gateway_pb2.AskRequest(header=header), gateway_pb2.AskRequest(media_chunk=data)])
                )
            )
    assert (
        info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "unknown pruning preset" in info.value.details()
    )
    names = [s.stage for s in balanced.pruning.stages]
    assert {"prefill_drop", "kv_compress", "decode_evict"} <= set(names)
    assert balanced.kv_num_bytes < off.kv_num_bytes
    assert balanced.pruning.kv_bytes_after == balanced.kv_num_bytes
    assert list(off.pruning.stages) == [] and len(off.token_ids) >= 1
