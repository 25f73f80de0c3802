"""The prefill core batches and chunks prompts without changing any request's result.

Several prompts of different lengths and frame counts go through `LocalPrefillStage` at once
(real tiny Qwen2-VL and Qwen2.5-VL checkpoints, float32), batched into one step or chunked over
many; each request's first token and KV cache must equal (a) prefilling it alone and (b)
`model.generate(do_sample=False)` on the unsplit model.

Batched and chunked matrix products may round differently from single ones (a different reduction
order), so the KV caches are compared within KV_ATOL. The first token is compared exactly; where
it differs, the test shows it was a near-tie: the reference's top-2 logits within TIE_TOL and the
token one of those two. Nothing is hidden: a token that differs beyond a near-tie fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import pytest
import torch

from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import reference_inputs
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig, SamplingFailed
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.prefill_svc.whole_prefill import prefill_alone
from epd.stages.contracts import EncodedMedia
from epd.stages.errors import ResourceExhausted
from epd.stages.messages import question_messages
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig
from tests.log_records import log_records
from tests.reference import decode_for_test

KV_ATOL = 1e-4
TIE_TOL = 1e-3
QWEN2_FAMILIES = ["qwen2_vl", "qwen2_5_vl"]  # conftest's tiny models (`tiny_models`)
# (media, frames, question): prompts from ~40 to ~430 tokens, videos and an image.
CASES = [
    ("mp4", 4, "what colour is the moving square?"),
    ("png", 1, "describe this image"),
    ("mp4", 64, "which direction does it move?"),
    ("mp4_b", 8, "how many objects are there in the video?"),
    ("mp4", 16, "what happens at the end?"),
]
BATCHED = PrefillSchedulerConfig(max_prefill_tokens_per_step=4096, prefill_chunk_tokens=None)
CHUNKED = PrefillSchedulerConfig(max_prefill_tokens_per_step=160, prefill_chunk_tokens=48)


class Family:
    """One checkpoint: its adapter, every case's media and its references."""

    def __init__(self, model_dir, media_files) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.adapter = load_adapter(ModelConfig(model=str(model_dir)), "all")
        processor = AutoProcessor.from_pretrained(model_dir)
        model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self.media, self.generated = [], []
        for media, num_frames, question in CASES:
            video = decode_for_test(media_files[media], num_frames)
            inputs = self.adapter.preprocess(video)
            with torch.inference_mode():
                embeds = self.adapter.encode(inputs)
            meta = VisualMeta(
                inputs.modality, inputs.grid_thw, inputs.second_per_grid_t, int(embeds.shape[0])
            )
            self.media.append(EncodedMedia(embeds, meta, video.num_frames, [], 0.0, 0.0))
            kind = "image" if video.is_image else "video"
            messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
            with torch.inference_mode():
                out = model.generate(
                    **reference_inputs(processor, video, messages),
                    do_sample=False,
                    max_new_tokens=1,
                    return_dict_in_generate=True,
                    output_logits=True,
                )
            # the prompt's cache (the first token is not fed back when generation stops at one)
            cache = out.past_key_values
            self.generated.append(
                {
                    "token": int(out.sequences[0, -1]),
                    "logits": out.logits[0][0],
                    "keys": [layer.keys for layer in cache.layers],
                    "values": [layer.values for layer in cache.layers],
                }
            )
        # Alone: the unbatched path the service ran before the core (adapter.prefill), one by one.
        engine = PrefillEngine(PrefillConfig(), self.adapter)
        self.alone = [
            prefill_alone(engine, question_messages(q, m), media, GREEDY)
            for (m, _, q), media in zip(_kinds(), self.media, strict=True)
        ]


GREEDY = GenerationConfig(max_new_tokens=1)


def _kinds():
    return [("image" if media == "png" else "video", n, q) for media, n, q in CASES]


@pytest.fixture(scope="module")
def families(tiny_models, media_files) -> dict[str, Family]:
    return {family: Family(tiny_models[family], media_files) for family in QWEN2_FAMILIES}


@pytest.fixture
def make_stage():
    """make_stage(adapter, scheduler): a prefill stage on its own model thread, whose tokenizer and
    model threads end with the test."""
    stages: list[LocalPrefillStage] = []

    def make(adapter, scheduler: PrefillSchedulerConfig) -> LocalPrefillStage:
        engine = PrefillEngine(PrefillConfig(scheduler=scheduler), adapter)
        stages.append(LocalPrefillStage(engine, KvStore(1 << 30, 600.0), ModelThread()))
        return stages[-1]

    yield make
    for stage in stages:
        stage.close_tokenizer()
        stage.model_thread.close()


async def prefill_all(stage: LocalPrefillStage, fam: Family, pruning=PruningConfig()):
    calls = [
        stage.prefill(question_messages(q, m), media, GREEDY, f"r{i}", pruning)
        for i, ((m, _, q), media) in enumerate(zip(_kinds(), fam.media, strict=True))
    ]
    return await asyncio.gather(*calls)


def assert_same_token(got: int, expected: int, reference_logits: torch.Tensor, what: str) -> None:
    if got == expected:
        return
    top2 = reference_logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert got in top2.indices.tolist() and gap <= TIE_TOL, (
        f"{what}: first token {got} != {expected} and not a near-tie (top-2 gap {gap:.2e} > {TIE_TOL})"
    )


def assert_close_kv(keys, values, ref_keys, ref_values, what: str) -> None:
    assert len(keys) == len(ref_keys)
    for layer, (k, v, rk, rv) in enumerate(zip(keys, values, ref_keys, ref_values, strict=True)):
        assert k.shape == rk.shape and v.shape == rv.shape, f"{what}: layer {layer} shape"
        err = max(float((k - rk).abs().max()), float((v - rv).abs().max()))
        assert err <= KV_ATOL, f"{what}: layer {layer} KV differs by {err:.2e} > {KV_ATOL}"


@pytest.mark.parametrize("family", QWEN2_FAMILIES)
@pytest.mark.parametrize("scheduler", [BATCHED, CHUNKED], ids=["batched", "chunked"])
def test_concurrent_prompts_equal_alone_and_generate(families, family, scheduler, make_stage):
    fam = families[family]
    stage = make_stage(fam.adapter, scheduler)
    handles = asyncio.run(prefill_all(stage, fam))
    lengths = [h.num_prompt_tokens for h in handles]
    load = stage.load()
    if scheduler is BATCHED:  # fewer steps than requests: some shared a forward
        assert load.num_steps < len(CASES), load
    else:  # the longest prompt alone needs this many chunks
        assert load.num_steps >= -(-max(lengths) // scheduler.prefill_chunk_tokens), load
        assert max(lengths) > scheduler.max_prefill_tokens_per_step, "no prompt long enough to need chunks"
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert stage.core.runner.num_partial == 0  # type: ignore[attr-defined]
    for i, (handle, alone, gen) in enumerate(zip(handles, fam.alone, fam.generated, strict=True)):
        what = f"{family} case {CASES[i]}"
        cache = stage.kv_store.take(handle.kv_handle)
        assert handle.num_prompt_tokens == alone.handle.num_prompt_tokens == cache.num_cached_tokens
        assert handle.next_position_ids == alone.handle.next_position_ids
        assert_close_kv(cache.keys, cache.values, alone.cache.keys, alone.cache.values, what + " vs alone")
        assert_close_kv(cache.keys, cache.values, gen["keys"], gen["values"], what + " vs generate")
        assert_same_token(
            handle.first_token_id, alone.handle.first_token_id, gen["logits"], what + " vs alone"
        )
        assert_same_token(handle.first_token_id, gen["token"], gen["logits"], what + " vs generate")
    assert len(set(lengths)) == len(lengths), "the cases should differ in length"


def test_pruned_requests_keep_their_exact_semantics_among_batched_ones(families, make_stage):
    """A prefill-drop + KV-compression request runs alone and whole: bit for bit its unbatched result."""
    fam = families["qwen2_vl"]
    pruning = PruningConfig(
        prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.25, kv_compress=True, kv_keep_ratio=0.5
    )
    stage = make_stage(fam.adapter, CHUNKED)
    m, _, q = _kinds()[2]

    async def run():
        plain = prefill_all(stage, fam)
        pruned = stage.prefill(question_messages(q, m), fam.media[2], GREEDY, "pruned", pruning)
        return await asyncio.gather(plain, pruned)

    plain, pruned = asyncio.run(run())
    expected = prefill_alone(stage.engine, question_messages(q, m), fam.media[2], GREEDY, pruning)
    got = stage.kv_store.take(pruned.kv_handle)
    assert pruned.kept_visual_token_index == expected.handle.kept_visual_token_index
    assert len(pruned.kept_visual_token_index) < fam.media[2].meta.num_visual_tokens  # it did drop
    assert (pruned.first_token_id, pruned.num_cached_tokens) == (
        expected.handle.first_token_id,
        expected.handle.num_cached_tokens,
    )
    assert all(
        torch.equal(a, b)
        for a, b in zip(got.keys + got.values, expected.cache.keys + expected.cache.values, strict=True)
    )
    assert pruned.pruning.stages == expected.handle.pruning.stages
    for handle, alone, gen in zip(plain, fam.alone, fam.generated, strict=True):
        assert_same_token(
            handle.first_token_id, alone.handle.first_token_id, gen["logits"], "beside a pruned one"
        )


def test_cancelled_requests_leave_the_queue_and_free_their_chunks(families, make_stage):
    fam = families["qwen2_vl"]
    stage = make_stage(
        fam.adapter, PrefillSchedulerConfig(max_prefill_tokens_per_step=32, prefill_chunk_tokens=16)
    )
    (m_long, _, q_long), media_long = _kinds()[2], fam.media[2]
    (m_short, _, q_short), media_short = _kinds()[0], fam.media[0]

    async def run():
        long = asyncio.create_task(
            stage.prefill(question_messages(q_long, m_long), media_long, GREEDY, "long")
        )
        waiting = asyncio.create_task(
            stage.prefill(question_messages(q_short, m_short), media_short, GREEDY, "w")
        )
        while stage.load().num_waiting + stage.load().num_running < 2:
            await asyncio.sleep(0.001)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        queued = [r.request_id for r in stage.core.scheduler.requests()]
        # the long one is part-way through its chunks: cancel it too
        while stage.core.runner.num_partial == 0:  # type: ignore[attr-defined]
            await asyncio.sleep(0.001)
        long.cancel()
        await asyncio.gather(long, return_exceptions=True)
        left = [r.request_id for r in stage.core.scheduler.requests()]
        # a later request runs to the end, after which the core has released the cancelled chunks
        handle = await stage.prefill(question_messages(q_short, m_short), media_short, GREEDY, "after")
        return queued, left, handle

    queued, left, handle = asyncio.run(run())
    assert queued == ["long"]  # the cancelled one left the queue at once
    assert left == []
    assert stage.core.runner.num_partial == 0  # type: ignore[attr-defined]
    assert len(stage.kv_store) == 1  # only the request that finished stored a cache
    assert handle.first_token_id == fam.alone[0].handle.first_token_id


def test_a_full_queue_refuses_with_the_flag_that_raises_it(families, make_stage):
    fam = families["qwen2_vl"]
    stage = make_stage(
        fam.adapter,
        PrefillSchedulerConfig(
            max_prefill_tokens_per_step=32, prefill_chunk_tokens=16, max_waiting_prefills=1
        ),
    )
    (m, _, q) = _kinds()[2]

    async def run():
        first = asyncio.create_task(stage.prefill(question_messages(q, m), fam.media[2], GREEDY, "first"))
        # Prompts render on a pool of threads and join the queue as their renders end: `first` is
        # in it before `second` comes (it stays there, waiting or running, until its prefill ends).
        deadline = time.monotonic() + 60
        while not stage.core.scheduler.requests() and not first.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        assert stage.core.scheduler.requests(), "the first prefill never queued"
        with pytest.raises(ResourceExhausted, match="--max-waiting-prefills"):
            await stage.prefill(question_messages(q, m), fam.media[2], GREEDY, "second")
        return await first

    handle = asyncio.run(run())
    assert handle.first_token_id == fam.alone[2].handle.first_token_id  # the admitted one was not dropped


def test_bad_requests_never_queue(families, make_stage):
    fam = families["qwen2_vl"]
    stage = make_stage(fam.adapter, BATCHED)
    media = fam.media[0]
    wrong = replace(media, embeds=media.embeds[:-1])  # one embedding short: a different model's encoder

    async def run():
        with pytest.raises(ValueError, match="encoder and prefill serve different models"):
            await stage.prefill(question_messages("what?"), wrong, GREEDY, "bad")

    asyncio.run(run())
    assert stage.load().num_steps == 0 and not stage.core.scheduler.requests()


def test_a_request_whose_first_token_cannot_be_sampled_fails_alone(families, make_stage):
    """Among prompts batched into one step, one whose logits are NaN (an inf in its embeddings)
    with a temperature cannot sample its first token: it fails with that error, and the others of
    the step get their tokens, as alone."""
    fam = families["qwen2_vl"]
    stage = make_stage(fam.adapter, BATCHED)
    sizes: list[int] = []
    prefill_chunks = fam.adapter.prefill_chunks

    def counted(rows):
        sizes.append(len(rows))
        return prefill_chunks(rows)

    (m, _, q), media = _kinds()[0], fam.media[0]
    embeds = media.embeds.clone()
    embeds[0] = float("inf")
    poisoned = replace(media, embeds=embeds)
    sampled = GenerationConfig(max_new_tokens=1, temperature=1.0, seed=1)

    async def run():
        calls = [stage.prefill(question_messages(q, m), media, GREEDY, f"good{i}") for i in range(2)]
        calls.insert(1, stage.prefill(question_messages(q, m), poisoned, sampled, "poisoned"))
        return await asyncio.gather(*calls, return_exceptions=True)

    scheduler = stage.core.scheduler
    schedule = scheduler.schedule
    # No step until all three are queued, so that they share one.
    scheduler.schedule = lambda: schedule() if len(scheduler.requests()) == 3 else []  # type: ignore[method-assign]
    fam.adapter.prefill_chunks = counted
    try:
        with log_records("epd.prefill_svc.runner", logging.WARNING) as records:
            results = asyncio.run(run())
    finally:
        del fam.adapter.prefill_chunks
    assert max(sizes) == 3, f"the three shared a step: {sizes}"
    assert isinstance(results[1], SamplingFailed) and "are not finite numbers" in str(results[1])
    # Logged on the model thread, outside the request's context: its line still carries its id.
    (failure,) = [r for r in records if "after its forward pass" in r.getMessage()]
    assert failure.request_id == "poisoned"  # type: ignore[attr-defined]
    assert [r.first_token_id for r in (results[0], results[2])] == [fam.alone[0].handle.first_token_id] * 2
    assert not stage.core.scheduler.requests()
