"""Qwen3-VL through the stack: the encoder's DeepStack features and group times cross Encode ->
Prefill (in one process, and over gRPC between three service processes) and the answer equals
`model.generate(do_sample=False)` token for token, for 8 and 32 frames and an image, on a tiny
checkpoint of the real transformers classes. Negative control: the same pipeline with the
DeepStack features zeroed on the way gives other tokens. Batched and chunked prefill and batched
tower steps keep DeepStack aligned (same tokens); the token cache never serves one family's entry
to another; pruning stages that cannot keep DeepStack aligned are INVALID_ARGUMENT naming the
stage and the family, and the encoder stages that can are exact when they drop nothing. Frame
groups are sized as the whole clip (a clip over the processor's t x h x w bound shrinks, as
generate()'s) and a 1-frame last group is padded as the clip's, merged or not.
Qwen3-VL MoE (model_type qwen3_vl_moe, the same adapter on the MoE classes) gets one stack of its
own: its 8-frame and image answers, asked together, equal generate()'s, and it refuses the same
pruning stages naming its family."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers.video_utils import VideoMetadata

from epd.client import EpdClient, EpdError
from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCache, TokenCacheConfig, make_cache_key
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.adapter import VisualFeatures
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.resources import demo_model_dir
from epd.stages.contracts import EncodedMedia, MediaInput
from epd.stages.errors import InvalidRequest, NotFound, ResourceExhausted
from epd.stages.messages import question_messages
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import encoder_pb2
from epd.video.types import MediaError, SamplingOptions
from tests.families import (
    assert_pipeline_answers_as_generate,
    assert_reference_varies,
    build_qwen3_vl_moe_checkpoint,
    generate_on_whole_clip,
    make_clip_over_qwen3_size_limit,
)
from tests.reference import decode_for_test
from tests.stack import Stack

QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 20
CASES = [("mp4", 8), ("mp4", 32), ("png", 1)]
MOE_CASES = [("mp4", 8), ("png", 1)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "m", TinyVLMSpec(family="qwen3_vl"))


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    with Stack(checkpoint, tmp_path_factory.mktemp("logs_q3")) as s:
        yield s


@pytest.fixture(scope="module")
def pipeline(checkpoint):
    with build_embedded_pipeline(ModelConfig(model=str(checkpoint))) as pipeline:
        yield pipeline


def _reference(model, processor, video) -> list[int]:
    """generate() on the processor's own inputs; video metadata as a transformers user gives it
    (the source's fps, the decoded frames' indices), so the prompt's `<t seconds>` are the real times."""
    kind = "image" if video.is_image else "video"
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if video.is_image:
        inputs = processor(text=[text], images=[video.frames[0]], return_tensors="pt")
    else:
        indices = [round(t * video.source_fps) for t in video.timestamps_s]
        meta = VideoMetadata(total_num_frames=max(indices) + 1, fps=video.source_fps, frames_indices=indices)
        kwargs = {"do_sample_frames": False, "cap_pixels_per_frame": False, "video_metadata": [meta]}
        inputs = processor(text=[text], videos=[video.frames], return_tensors="pt", videos_kwargs=kwargs)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _references(checkpoint, media_files, cases) -> dict:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    processor = AutoProcessor.from_pretrained(checkpoint)
    return {
        (media, n): _reference(model, processor, decode_for_test(media_files[media], n)) for media, n in cases
    }


@pytest.fixture(scope="module")
def references(checkpoint, media_files):
    return _references(checkpoint, media_files, CASES)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return build_qwen3_vl_moe_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe") / "m")


@pytest.fixture(scope="module")
def moe_stack(moe_checkpoint, tmp_path_factory):
    """Prefill chunks prompts over 64 tokens, so the 8-frame prompt runs in several chunks."""
    extra = {"prefill": ["--prefill-chunk-tokens", "64"]}
    with Stack(moe_checkpoint, tmp_path_factory.mktemp("logs_q3moe"), extra=extra) as s:
        yield s


def _request(
    media_files, media: str, num_frames: int, pruning: PruningConfig = PruningConfig()
) -> AskRequest:
    return AskRequest(
        messages=question_messages(QUESTION),
        media=MediaInput(media_files[media].read_bytes()),
        sampling=SamplingOptions(num_frames=num_frames),
        generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        pruning=pruning,
    )


async def _summary(pipeline, request: AskRequest) -> AskSummary:
    async for item in pipeline.ask(request):
        if isinstance(item, AskSummary):
            return item
    raise AssertionError("no summary")


def _tokens(pipeline, request: AskRequest) -> list[int]:
    return asyncio.run(_summary(pipeline, request)).token_ids


@pytest.mark.parametrize("media,num_frames", CASES)
def test_reference_output_varies(references, media, num_frames):
    ref = references[(media, num_frames)]
    assert len(ref) == MAX_NEW_TOKENS, "the reference stopped early; the comparison would prove little"
    assert len(set(ref)) > 4, "the tiny model repeats one token; raise its weight scale"


@pytest.mark.parametrize("media,num_frames", CASES)
def test_three_services_equal_generate(stack, media_files, references, media, num_frames):
    with EpdClient(stack.gateway) as client:
        result = client.ask(
            media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS
        )
    assert result.token_ids == references[(media, num_frames)]
    assert result.num_frames == (1 if media == "png" else num_frames)
    assert result.kv_num_bytes > 0


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(pipeline, media_files, references, media, num_frames):
    assert _tokens(pipeline, _request(media_files, media, num_frames)) == references[(media, num_frames)]


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


@pytest.fixture(scope="module")
def clips(media_files, tmp_path_factory) -> dict:
    """media_files and "big": a clip whose 31-32 frames are over the processor's size.longest_edge."""
    return {**media_files, "big": make_clip_over_qwen3_size_limit(tmp_path_factory.mktemp("big_clip"))}


@pytest.fixture(scope="module")
def unmerged_pipeline(checkpoint):
    """Every frame group `frames_per_group` (2) frames, an odd count's last one 1 frame: what a
    request gets under load with the default flags (groups merge only for a request alone)."""
    model = ModelConfig(model=str(checkpoint))
    encoder = EncoderConfig(model=model, merge_decoded_groups=False)
    with build_embedded_pipeline(model, encoder=encoder) as pipeline:
        yield pipeline


def test_the_big_clip_is_over_the_size_limit_and_one_merged_group_is_not(checkpoint, clips):
    """What the frame-group cases below rely on: the processor shrinks 31-32 frames of the big
    clip, but not the 8 of the largest merged group (so sizing a group alone gives another grid)."""
    from transformers import AutoProcessor

    limit_px = AutoProcessor.from_pretrained(checkpoint).video_processor.size.longest_edge
    frame_px = 224 * 192
    assert 8 * frame_px < limit_px < 31 * frame_px


@pytest.mark.parametrize("media,num_frames", [("big", 32), ("mp4", 5), ("big", 31)])
def test_frame_groups_are_sized_and_padded_as_the_whole_clip(
    unmerged_pipeline, whole, clips, media, num_frames
):
    """The encoder preprocesses 2-frame groups; the processor sizes the whole clip (t x h x w
    within its bounds: the big clip's frames shrink) and pads an odd clip's last temporal patch
    with its last frame (5 and 31 frames: a 1-frame last group). Prompt length, visual tokens and
    answer are generate()'s."""
    assert_pipeline_answers_as_generate(unmerged_pipeline, whole, clips[media], num_frames, MAX_NEW_TOKENS)


def test_three_services_size_merged_frame_groups_as_the_whole_clip(stack, whole, clips):
    """Default flags, a request alone: groups merge up to 8 frames, an odd last one included."""
    with EpdClient(stack.gateway) as client:
        result = client.ask(clips["big"], QUESTION, num_frames=31, max_new_tokens=MAX_NEW_TOKENS)
    got = (result.num_prompt_tokens, result.num_visual_tokens, result.token_ids)
    assert got == generate_on_whole_clip(whole, clips["big"], 31, MAX_NEW_TOKENS)


def test_a_one_frame_video_is_invalid_argument_saying_what_to_ask_for(stack, media_files):
    """The processor refuses a clip shorter than one temporal patch (generate() cannot answer it
    either): the caller learns what to change, not an internal error."""
    with EpdClient(stack.gateway) as client, pytest.raises(EpdError) as err:
        client.ask(media_files["mp4"], QUESTION, num_frames=1, max_new_tokens=4)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "at least 2 frames; ask for num_frames >= 2" in err.value.message
    assert stack.alive()


def test_a_one_frame_sample_by_fps_is_refused_naming_the_options_it_used(checkpoint, media_files):
    """A request sampling by fps with max_frames 1 (or min_frames 1 on a short span) gets one frame:
    the refusal names the options that request set, not only num_frames, which it did not."""
    adapter = load_adapter(ModelConfig(model=str(checkpoint)), "encoder")
    engine = EncoderEngine(EncoderConfig(), adapter)
    try:
        with pytest.raises(MediaError, match=r"sampling by fps: min_frames and max_frames >= 2"):
            engine.encode(
                MediaInput(media_files["mp4"].read_bytes()),
                SamplingOptions(fps=1.0, min_frames=1, max_frames=1),
                lambda e: None,
            )
    finally:
        engine.close()


def test_the_token_budget_counts_a_one_frame_last_group_as_one_temporal_patch(checkpoint, media_files):
    """5 frames are 3 temporal patches of 12 visual tokens: a budget of 36 takes them, 35 refuses
    them. The last group's 1 frame fills a whole patch; taken as its rate per frame it would
    count 60 and refuse the 36 too."""
    adapter = load_adapter(ModelConfig(model=str(checkpoint)), "encoder")
    data, sampling = media_files["mp4"].read_bytes(), SamplingOptions(num_frames=5)

    def encode(max_visual_tokens: int) -> EncodedMedia:
        engine = EncoderEngine(
            EncoderConfig(merge_decoded_groups=False, max_visual_tokens=max_visual_tokens), adapter
        )
        try:
            return engine.encode(MediaInput(data), sampling, lambda e: None)
        finally:
            engine.close()

    assert encode(36).meta.num_visual_tokens == 36
    with pytest.raises(ResourceExhausted, match="about 36 visual tokens"):
        encode(35)


def test_zeroing_the_deepstack_features_on_the_way_changes_the_answer(
    pipeline, media_files, references, monkeypatch
):
    """Negative control: the same in-process pipeline, with the features that cross Encode ->
    Prefill zeroed (what dropping them would do), no longer equals generate(): for most cases (a
    tiny random model's greedy answer to one input can survive it; the 8-frame clip's did once the
    test clip changed)."""
    engine = pipeline.encoder.engine
    real = engine._encode_frames

    zeroed = []

    def without_deepstack(*args, **kwargs) -> EncodedMedia:
        media = real(*args, **kwargs)
        zeroed.append(True)
        assert len(media.deepstack) == engine.adapter.num_deepstack_layers > 0
        return dataclasses.replace(media, deepstack=[torch.zeros_like(d) for d in media.deepstack])

    monkeypatch.setattr(engine, "_encode_frames", without_deepstack)
    monkeypatch.setattr(engine.cache, "get_entry", lambda key: None)  # encode afresh
    monkeypatch.setattr(engine.cache, "put", lambda key, media, facts=None: None)  # and store nothing
    kept = sum(_tokens(pipeline, _request(media_files, m, n)) == references[(m, n)] for m, n in CASES)
    assert len(zeroed) == len(CASES), "a request was not encoded afresh (a cache hit skips the zeroing)"
    assert kept < len(CASES) / 2, (
        f"{kept} of {len(CASES)} answers unchanged with the DeepStack features zeroed"
    )


def test_chunked_prefill_keeps_deepstack_aligned(checkpoint, media_files, references):
    """Three requests at once through a prefill core that chunks prompts over 64 tokens (each
    chunk adds the DeepStack rows of its own visual positions). Each answer equals generate()'s."""
    prefill = PrefillConfig(scheduler=PrefillSchedulerConfig(prefill_chunk_tokens=64))
    with build_embedded_pipeline(ModelConfig(model=str(checkpoint)), prefill=prefill) as pipeline:

        async def run():
            return await asyncio.gather(*(_summary(pipeline, _request(media_files, m, n)) for m, n in CASES))

        summaries = asyncio.run(run())
        num_steps = pipeline.prefill.load().num_steps
    for (media, num_frames), summary in zip(CASES, summaries, strict=True):
        assert summary.token_ids == references[(media, num_frames)], (media, num_frames)
    assert summaries[1].num_prompt_tokens > 64 * 3, "the 32-frame prompt should have run in several chunks"
    assert num_steps >= summaries[1].num_prompt_tokens // 64, "it was not chunked"


def test_batched_tower_calls_and_prefill_rows_equal_each_alone(pipeline, media_files):
    """One tower call for several frame groups splits every DeepStack feature back per group; one
    padded prefill forward of several prompts, and a prompt continued chunk by chunk, equal each
    prompt prefilled alone (logits and KV cache)."""
    from epd.model_runtime.adapter import PrefillChunk, VisualMeta
    from epd.stages.messages import to_chat_template

    adapter = pipeline.encoder.engine.adapter
    videos = [decode_for_test(media_files[m], n) for m, n in CASES]
    inputs = [adapter.preprocess(v) for v in videos]
    batched = adapter.encode_features_batch(inputs)
    alone = [adapter.encode_features(i) for i in inputs]
    for b, a in zip(batched, alone, strict=True):
        torch.testing.assert_close(b.embeds, a.embeds, rtol=1e-5, atol=1e-5)
        assert b.deepstack is not None and a.deepstack is not None and len(b.deepstack) == 2
        for x, y in zip(b.deepstack, a.deepstack, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0].deepstack[0], alone[0].deepstack[1]), "the features differ by layer"

    prompts = []
    for i, f in zip(inputs, alone, strict=True):
        meta = VisualMeta(
            i.modality, i.grid_thw, i.second_per_grid_t, f.embeds.shape[0], i.group_timestamps_s
        )
        prompts.append(adapter.build_prompt(to_chat_template(question_messages(QUESTION), i.modality), meta))
    whole = [adapter.prefill_features(p, f) for p, f in zip(prompts, alone, strict=True)]
    rows = [PrefillChunk(p, f.embeds, 0, p.num_tokens, deepstack=f.deepstack) for p, f in zip(prompts, alone)]
    for result, ref in zip(adapter.prefill_chunks(rows), whole, strict=True):
        torch.testing.assert_close(result.last_logits, ref.last_logits, rtol=1e-4, atol=1e-4)
        kv = adapter.chunk_cache_to_kv(result.cache)
        for k, k_ref in zip(kv.keys, ref.cache.keys, strict=True):
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
    long_prompt, features = prompts[1], alone[1]
    cache, start, step = None, 0, 50  # chunks that cut through the visual tokens
    while start < long_prompt.num_tokens:
        end = min(start + step, long_prompt.num_tokens)
        row = PrefillChunk(long_prompt, features.embeds, start, end, cache, deepstack=features.deepstack)
        (result,) = adapter.prefill_chunks([row])
        cache, start = result.cache, end
    torch.testing.assert_close(result.last_logits, whole[1].last_logits, rtol=1e-4, atol=1e-4)
    dropped = PrefillChunk(long_prompt, features.embeds, 0, 50, None, deepstack=None)
    with pytest.raises(ValueError, match="needs DeepStack features"):
        adapter.prefill_chunks([dropped])


def test_the_wire_carries_every_deepstack_feature_and_counts_them_in_the_budget(pipeline, media_files):
    media = pipeline.encoder.engine.encode(
        MediaInput(media_files["mp4"].read_bytes()), SamplingOptions(num_frames=8), lambda e: None
    )
    assert len(media.deepstack) == 2 and len(media.meta.group_timestamps_s) == media.meta.grid_thw[0] == 4
    msg = encoder_pb2.EncodeResult.FromString(convert.encode_result_to_proto(media).SerializeToString())
    chunks = list(convert.encoded_media_chunks(media))
    total = media.embeds.numel() * 4 * 3  # float32 embeddings + 2 features
    asm = TensorAssembler(total)
    for chunk in chunks:
        asm.add(chunk)
    back = convert.encoded_media_from_proto(msg, asm.tensors())
    assert back.meta == media.meta
    assert all(torch.equal(a, b) for a, b in zip(back.deepstack, media.deepstack, strict=True))
    assert len(back.deepstack) == 2
    too_small = TensorAssembler(total - 1)  # the embeddings alone fit; the features do not
    with pytest.raises(Exception, match="transfer limit"):
        for chunk in chunks:
            too_small.add(chunk)
    missing = {"visual_embeds": asm.tensors()["visual_embeds"], "deepstack.0": asm.tensors()["deepstack.0"]}
    with pytest.raises(InvalidRequest, match="names 2 DeepStack features but 1 were sent"):
        convert.encoded_media_from_proto(msg, missing)


def test_a_qwen2_vl_entry_is_never_served_to_qwen3_vl(
    checkpoint, media_files, tmp_path, monkeypatch, closing
):
    """Same bytes, same sampling, same cache directory and (forced) the same model fingerprint:
    only the family differs, and the Qwen3-VL encoder misses what the Qwen2-VL one stored."""
    cache = TokenCacheConfig(disk_dir=str(tmp_path / "cache"))
    qwen2 = closing(
        EncoderEngine(
            EncoderConfig(cache=cache), load_adapter(ModelConfig(model=str(demo_model_dir())), "encoder")
        )
    )
    qwen3 = closing(
        EncoderEngine(EncoderConfig(cache=cache), load_adapter(ModelConfig(model=str(checkpoint)), "encoder"))
    )
    monkeypatch.setattr(qwen3.adapter, "fingerprint", qwen2.adapter.fingerprint)
    data = media_files["mp4"].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    sampling = SamplingOptions(num_frames=8)
    qwen2.encode(MediaInput(data), sampling, lambda e: None)
    assert qwen2.encode(MediaInput(None, sha), sampling, lambda e: None).cache_hit  # positive control
    assert TokenCache(cache).stats().disk_bytes > 0
    with pytest.raises(NotFound, match="not cached here"):
        qwen3.encode(MediaInput(None, sha), sampling, lambda e: None)
    assert qwen2.cache_key(sha, sampling) != qwen3.cache_key(sha, sampling)
    assert make_cache_key(sha, {"x": 1}, family="qwen2_vl") != make_cache_key(
        sha, {"x": 1}, family="qwen3_vl"
    )
    # And the Qwen3-VL entry it stores holds its DeepStack features and times, on disk too.
    qwen3.encode(MediaInput(data), sampling, lambda e: None)
    restarted = closing(EncoderEngine(EncoderConfig(cache=cache), qwen3.adapter))
    hit = restarted.encode(MediaInput(None, sha), sampling, lambda e: None)
    assert hit.cache_hit and len(hit.deepstack) == 2 and len(hit.meta.group_timestamps_s) == 4


@pytest.mark.parametrize(
    "preset,knobs,stage",
    [
        ("balanced", {}, "spatial_merge (encoder stage)"),
        ("", {"spatial_merge": True}, "spatial_merge (encoder stage)"),
        ("", {"prefill_drop": True, "prefill_keep_ratio": 0.5}, "prefill_drop (prefill stage)"),
        ("", {"kv_compress": True, "kv_keep_ratio": 0.5}, "kv_compress (prefill stage)"),
        ("", {"decode_evict": True}, "decode_evict (decode stage)"),
    ],
)
def test_pruning_stages_that_would_lose_deepstack_are_invalid_argument(
    stack, media_files, preset, knobs, stage
):
    with EpdClient(stack.gateway) as client, pytest.raises(EpdError) as err:
        client.ask(
            media_files["mp4"], QUESTION, num_frames=8, max_new_tokens=4, pruning=preset, pruning_knobs=knobs
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert stage in err.value.message and "qwen3_vl" in err.value.message


def test_prefill_refuses_them_too_before_queueing(pipeline, media_files):
    """Prefill does not rely on the encoder having refused (another client may send it media)."""
    media = pipeline.encoder.engine.encode(
        MediaInput(media_files["png"].read_bytes()), SamplingOptions(), lambda e: None
    )
    with pytest.raises(InvalidRequest, match=r"prefill_drop \(prefill stage\).*qwen3_vl"):
        pipeline.prefill.engine.render(
            question_messages(QUESTION), media, GenerationConfig(), PruningConfig(prefill_drop=True)
        )
    with pytest.raises(InvalidRequest, match="carries 0 DeepStack features but this qwen3_vl model adds 2"):
        pipeline.prefill.engine.render(
            question_messages(QUESTION), dataclasses.replace(media, deepstack=[]), GenerationConfig()
        )


def test_encoder_stages_that_keep_deepstack_aligned_are_exact_when_they_drop_nothing(
    stack, media_files, references
):
    """Temporal dropping at threshold 0 keeps every token, and key tokens drop none: the request
    takes the kept-token path (encoder index, gathered prompt, gathered DeepStack rows) and must
    still equal generate(); with a real threshold it drops tokens and answers."""
    knobs = {"temporal_drop": True, "temporal_threshold": 0.0, "key_token_ratio": 0.1}
    with EpdClient(stack.gateway) as client:
        exact = client.ask(
            media_files["mp4"], QUESTION, num_frames=8, max_new_tokens=MAX_NEW_TOKENS, pruning_knobs=knobs
        )
        dropped = client.ask(
            media_files["mp4"],
            QUESTION,
            num_frames=8,
            max_new_tokens=MAX_NEW_TOKENS,
            pruning_knobs={**knobs, "temporal_threshold": 0.5, "kv_dtype": "bfloat16"},
        )
    assert exact.token_ids == references[("mp4", 8)]
    assert exact.pruning is not None and any(s.stage == "temporal" for s in exact.pruning.stages)
    temporal = next(s for s in dropped.pruning.stages if s.stage == "temporal")
    assert temporal.num_visual_tokens_out < temporal.num_visual_tokens_in
    assert dropped.num_visual_tokens == temporal.num_visual_tokens_out and len(dropped.token_ids) > 0


def test_prefill_features_without_deepstack_is_refused_by_the_adapter(pipeline, media_files):
    """The stages pass DeepStack through `prefill_features`; the adapter refuses to run without."""
    adapter = pipeline.prefill.engine.adapter
    with pytest.raises(ValueError, match="needs the tower's DeepStack features"):
        adapter.prefill_features(None, VisualFeatures(torch.zeros(1, adapter.hidden_size)))


def test_qwen3_vl_moe_three_services_equal_generate(moe_stack, moe_checkpoint, media_files):
    """The MoE family over gRPC between the three services: the 8-frame and image questions, sent
    together (so they may share prefill steps and the decode batch; the 8-frame prompt is
    chunked), each equal generate()'s tokens."""
    references = _references(moe_checkpoint, media_files, MOE_CASES)

    def ask(case):
        media, num_frames = case
        with EpdClient(moe_stack.gateway) as client:
            return client.ask(
                media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS
            )

    with ThreadPoolExecutor(len(MOE_CASES)) as pool:
        results = list(pool.map(ask, MOE_CASES))
    for case, result in zip(MOE_CASES, results, strict=True):
        assert_reference_varies(references[case], MAX_NEW_TOKENS)
        assert result.token_ids == references[case], case
        assert result.kv_num_bytes > 0
    assert results[0].num_prompt_tokens > 2 * 64, "the 8-frame prompt should have run in several chunks"


def test_qwen3_vl_moe_refuses_the_pruning_stages_dense_refuses_naming_its_family(moe_stack, media_files):
    with EpdClient(moe_stack.gateway) as client, pytest.raises(EpdError) as err:
        client.ask(media_files["png"], QUESTION, max_new_tokens=4, pruning_knobs={"prefill_drop": True})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prefill_drop (prefill stage)" in err.value.message and "qwen3_vl_moe" in err.value.message
