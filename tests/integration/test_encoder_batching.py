"""The encoder's batched vision tower, with the real tiny Qwen2-VL and Qwen2.5-VL (no servers):

- one tower call over the frame groups of several videos and an image gives each what it gets
  alone, up to float32 rounding (the towers attend within one image / temporal group only);
- through the stage, the first frame groups of several concurrent requests (held back behind a
  step in progress, so they are all waiting) go through the tower in one step, and every
  request's embeddings equal those of an unbatched encode;
- one request's groups queued behind a busy tower (`max_tower_jobs_per_request`) go through it
  in one call, with the embeddings of encoding group by group;
- a cancelled request's queued tower jobs leave the queue at once and never reach the tower;
- end to end (embedded pipeline), the greedy tokens of concurrent requests whose groups were
  batched equal those of the same requests sent one at a time and `generate()`'s. Where a token
  differs, the test passes only if `generate()`'s top-2 logits at that step were within
  NEAR_TIE of each other (a float-rounding flip, as vLLM documents for batching), and says so.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.stage import LocalEncodeStage
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import reference_inputs
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import EncodedMedia, MediaInput
from epd.stages.messages import question_messages
from epd.stages.model_thread import ModelThread
from epd.video.types import DecodedVideo, SamplingOptions
from tests.reference import decode_for_test

QWEN2_FAMILIES = ["qwen2_vl", "qwen2_5_vl"]  # conftest's tiny models (`tiny_models`)
HANG_GUARD_S = 120.0
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding of differently sized matrix products, nothing more
NEAR_TIE = 1e-3  # largest top-2 logit gap at which a differing greedy token is accepted
QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 16
# (media, num_frames): two videos of different sizes and lengths, the same video sampled
# differently, and an image; their groups have different grids.
REQUESTS = [("mp4", 8), ("mp4_b", 6), ("mp4", 4), ("png", 1)]
NO_CACHE = TokenCacheConfig(memory_budget_bytes=0)


@pytest.fixture(scope="module", params=QWEN2_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def adapter(tiny_models, family):
    return load_adapter(ModelConfig(model=str(tiny_models[family])), "encoder")


def _group(video: DecodedVideo, start: int, end: int) -> DecodedVideo:
    return replace(video, frames=video.frames[start:end], timestamps_s=video.timestamps_s[start:end])


def test_one_tower_call_equals_each_group_alone(adapter, media_files):
    clip, clip_b = decode_for_test(media_files["mp4"], 6), decode_for_test(media_files["mp4_b"], 4)
    image = decode_for_test(media_files["png"], 1)
    groups = [_group(clip, 0, 2), image, _group(clip_b, 0, 4), _group(clip, 2, 6)]
    inputs = [adapter.preprocess(g) for g in groups]
    assert len({i.grid_thw for i in inputs}) == 4, "the inputs should differ in shape"
    batched = adapter.encode_batch(inputs)
    alone = [adapter.encode(i) for i in inputs]
    assert [tuple(b.shape) for b in batched] == [tuple(a.shape) for a in alone]
    for b, a in zip(batched, alone, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    # The comparison means something: the groups' embeddings are not all alike.
    assert not torch.allclose(alone[0], alone[3][: alone[0].shape[0]], rtol=RTOL, atol=ATOL)


def _stage(adapter, **config) -> tuple[LocalEncodeStage, threading.Event]:
    """A stage whose first tower step waits on the model thread until the returned event is set,
    so that the groups submitted meanwhile are all waiting when the next step is scheduled."""
    # Groups as decoded pairs, never merged (`merge_decoded_groups`): the tests count them.
    config = {"merge_decoded_groups": False, **config}
    stage = LocalEncodeStage(EncoderEngine(EncoderConfig(cache=NO_CACHE, **config), adapter), ModelThread())
    release = threading.Event()
    execute = stage.runner.execute

    def held_execute(batch):
        assert release.wait(HANG_GUARD_S), "the test never released the tower"
        return execute(batch)

    stage.runner.execute = held_execute  # type: ignore[method-assign]
    return stage, release


async def _until(predicate, what: str) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.005)

    try:
        await asyncio.wait_for(poll(), HANG_GUARD_S)
    except TimeoutError:
        raise AssertionError(f"waited in vain for {what}") from None


def test_concurrent_requests_share_tower_steps_and_get_their_own_embeddings(adapter, media_files, closing):
    stage, release = _stage(adapter, max_tower_jobs_per_request=1)  # one group each in the queue
    datas = {name: media_files[name].read_bytes() for name in ("mp4", "mp4_b", "png")}

    async def scenario() -> list[EncodedMedia]:
        tasks = [
            asyncio.ensure_future(
                stage.encode(MediaInput(datas[m]), SamplingOptions(num_frames=n), lambda e: None, f"r{i}")
            )
            for i, (m, n) in enumerate(REQUESTS)
        ]
        # One first group is in the held step, the other requests' first groups wait for the next.
        # Each request's first group is in the held step or waiting for the next (two that arrive
        # in the same loop turn may share the held step).
        await _until(
            lambda: stage.load().num_running + stage.load().num_waiting == len(REQUESTS),
            "every request's first frame group to be queued",
        )
        first_step.append(stage.load().num_running)
        release.set()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S))

    first_step: list[int] = []
    try:
        outs = asyncio.run(scenario())
    finally:
        stage.close()  # its request drivers and decode workers; the model thread is the test's
        stage.model_thread.close()
    assert stage.runner.max_batch_size >= len(REQUESTS) - first_step[0], (
        "the waiting groups went through the tower together"
    )
    load = stage.load()
    assert (load.num_running, load.num_waiting) == (0, 0) and stage.scheduler.requests() == []
    assert load.num_steps < sum((n + 1) // 2 for _, n in REQUESTS), "fewer steps than frame groups"
    alone = closing(EncoderEngine(EncoderConfig(cache=NO_CACHE), adapter))
    for (media, num_frames), out in zip(REQUESTS, outs, strict=True):
        ref = alone.encode(MediaInput(datas[media]), SamplingOptions(num_frames=num_frames), lambda e: None)
        assert out.meta == ref.meta and out.num_frames == ref.num_frames
        torch.testing.assert_close(out.embeds, ref.embeds, rtol=RTOL, atol=ATOL)


def test_one_requests_queued_groups_merge_into_one_tower_call(adapter, media_files, closing):
    """While the tower is busy, the driver preprocesses and queues the request's next groups (up to
    `max_tower_jobs_per_request`); the next step encodes them all at once. The embeddings equal
    those of encoding group by group."""
    stage, release = _stage(adapter, max_tower_jobs_per_request=4)
    data = media_files["mp4"].read_bytes()
    # Group 2 comes out of the frame stream only once the first step runs: that step holds group 1
    # alone, however late the model thread forms its batch on a busy machine.
    in_step = threading.Event()
    held_execute = stage.runner.execute

    def execute(batch):
        in_step.set()
        return held_execute(batch)

    stage.runner.execute = execute  # type: ignore[method-assign]
    open_frames = stage.engine.open_frames

    def frames_after_the_first_step(data_, sha256, sampling, cancel=None, merge=False, cache_salt=""):
        meta, groups = open_frames(data_, sha256, sampling, cancel, merge, cache_salt)

        def gated():
            try:
                for i, group in enumerate(groups):
                    if i == 1:
                        assert in_step.wait(HANG_GUARD_S), "the first tower step never began"
                    yield group
            finally:
                groups.close()

        return meta, gated()

    stage.engine.open_frames = frames_after_the_first_step  # type: ignore[method-assign]

    async def scenario() -> EncodedMedia:
        task = asyncio.ensure_future(
            stage.encode(MediaInput(data), SamplingOptions(num_frames=8), lambda e: None, "r")
        )
        # Group 1 is in the held step; groups 2-4 (8 frames, 2 a group) queue behind it.
        await _until(
            lambda: stage.load().num_running == 1 and stage.load().num_waiting == 3,
            "the request's other three groups to be queued",
        )
        release.set()
        return await asyncio.wait_for(task, HANG_GUARD_S)

    try:
        out = asyncio.run(scenario())
    finally:
        stage.close()  # its request drivers and decode workers; the model thread is the test's
        stage.model_thread.close()
    assert stage.load().num_steps == 2 and stage.runner.max_batch_size == 3, "groups 2-4 went in one call"
    ref = closing(EncoderEngine(EncoderConfig(cache=NO_CACHE), adapter)).encode(
        MediaInput(data), SamplingOptions(num_frames=8), lambda e: None
    )
    assert out.meta == ref.meta
    torch.testing.assert_close(out.embeds, ref.embeds, rtol=RTOL, atol=ATOL)


def test_a_cancelled_requests_queued_jobs_leave_at_once_and_are_never_encoded(adapter, media_files):
    stage, release = _stage(adapter, max_tower_jobs_per_request=4)
    image, video = media_files["png"].read_bytes(), media_files["mp4"].read_bytes()

    async def scenario() -> EncodedMedia:
        kept = asyncio.ensure_future(
            stage.encode(MediaInput(image), SamplingOptions(), lambda e: None, "kept")
        )
        await _until(lambda: stage.load().num_running == 1, "the image's job in the held step")
        gone = asyncio.ensure_future(
            stage.encode(MediaInput(video), SamplingOptions(num_frames=8), lambda e: None, "gone")
        )
        await _until(lambda: stage.load().num_waiting == 4, "the video's four groups to be queued")
        gone.cancel()  # what gRPC does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert stage.load().num_waiting == 0, "the cancelled request's jobs left the queue at once"
        release.set()
        out = await asyncio.wait_for(kept, HANG_GUARD_S)
        await _until(lambda: stage.drivers.num_admitted == 0, "the cancelled driver to stop")
        return out

    try:
        out = asyncio.run(scenario())
    finally:
        stage.close()  # its request drivers and decode workers; the model thread is the test's
        stage.model_thread.close()
    assert out.num_frames == 1
    assert (
        stage.runner.num_patches_encoded
        == stage.engine.adapter.preprocess(decode_for_test(media_files["png"], 1)).pixel_values.shape[0]
    ), "only the image reached the tower"
    assert stage.drivers.num_cancelled == 1 and stage.scheduler.requests() == []


# -- end to end: greedy tokens --------------------------------------------------------------


def _ask_request(media_files, media: str, num_frames: int) -> AskRequest:
    return AskRequest(
        messages=question_messages(QUESTION),
        media=MediaInput(media_files[media].read_bytes()),
        sampling=SamplingOptions(num_frames=num_frames),
        generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
    )


async def _tokens(pipeline, request: AskRequest) -> list[int]:
    async for item in pipeline.ask(request):
        if isinstance(item, AskSummary):
            return item.token_ids
    raise AssertionError("no summary")


def _generate_with_scores(model, processor, video: DecodedVideo) -> tuple[list[int], list[torch.Tensor]]:
    """`generate(do_sample=False)` on the unsplit model: its tokens and each step's logits [vocab]."""
    kind = "image" if video.is_image else "video"
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": QUESTION}]}]
    inputs = reference_inputs(processor, video, messages)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), [s[0] for s in out.scores]


def assert_equal_or_near_tie(got: list[int], want: list[int], scores: list[torch.Tensor], what: str) -> None:
    """`got` equals `want` (generate's), or first differs where generate's top-2 logits were a
    near-tie and `got` took the runner-up; after that the sequences may go their own ways."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    assert i < len(got) and i < len(want), f"{what}: one answer stopped early at token {i}: {got} vs {want}"
    top2 = torch.topk(scores[i].float(), 2)
    gap = float(top2.values[0] - top2.values[1])
    assert got[i] in top2.indices.tolist() and gap <= NEAR_TIE, (
        f"{what}: token {i} is {got[i]}, generate() chose {want[i]} with a top-2 logit gap of {gap:.3g} "
        f"(> {NEAR_TIE}): not a near-tie, so batching changed the answer"
    )
    print(f"{what}: token {i} differs at a near-tie (top-2 gap {gap:.3g} <= {NEAR_TIE})")


def test_batched_answers_equal_one_at_a_time_and_generate(tiny_models, media_files, family):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = tiny_models[family]
    model = ModelConfig(model=str(model_dir))
    # One group queued per request: alone, each group is its own tower call; together, the first
    # groups of all requests wait for the held step.
    pipeline = build_embedded_pipeline(
        model,
        encoder=EncoderConfig(
            model=model, cache=NO_CACHE, max_tower_jobs_per_request=1, merge_decoded_groups=False
        ),
    )
    try:
        stage = pipeline.encoder
        assert isinstance(stage, LocalEncodeStage)
        requests = [_ask_request(media_files, m, n) for m, n in REQUESTS]
        one_at_a_time = [asyncio.run(_tokens(pipeline, r)) for r in requests]
        assert stage.runner.max_batch_size == 1

        release = threading.Event()

        async def concurrently() -> list[list[int]]:
            # Hold every shared model thread so that every request's first group queues, then let go.
            workers = stage.model_thread.num_workers
            held = asyncio.gather(
                *(stage.model_thread.run(release.wait, HANG_GUARD_S) for _ in range(workers))
            )
            tasks = [asyncio.ensure_future(_tokens(pipeline, r)) for r in requests]
            await _until(
                lambda: stage.load().num_running + stage.load().num_waiting == len(requests),
                "every request's first frame group to be queued",
            )
            first_step.append(stage.load().num_running)  # the step waiting for the model thread
            release.set()
            await held
            return list(await asyncio.wait_for(asyncio.gather(*tasks), HANG_GUARD_S))

        first_step: list[int] = []
        batched = asyncio.run(concurrently())
        assert stage.runner.max_batch_size >= len(requests) - first_step[0]
    finally:
        pipeline.close()

    hf = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    for (media, num_frames), alone, together in zip(REQUESTS, one_at_a_time, batched, strict=True):
        want, scores = _generate_with_scores(hf, processor, decode_for_test(media_files[media], num_frames))
        assert len(want) >= 8 and len(set(want)) > 2, "the reference says too little to compare"
        what = f"{family} {media} x{num_frames}"
        assert_equal_or_near_tie(alone, want, scores, what + " alone")
        assert_equal_or_near_tie(together, want, scores, what + " batched")


def test_a_real_difference_is_not_taken_for_a_near_tie(tiny_models, media_files):
    """Negative control of the check above: another video's answer differs from this one's where
    generate() was far from a tie, and the check says so."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir = tiny_models["qwen2_vl"]
    hf = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    want, scores = _generate_with_scores(hf, processor, decode_for_test(media_files["mp4"], 8))
    other = [(t + 1) % hf.config.text_config.vocab_size for t in want]
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_equal_or_near_tie(other, want, scores, "shifted tokens")
