"""Prefill's prefix cache in one process (`epd.gateway.embedded`), tiny Qwen2-VL and Qwen2.5-VL:
a three-turn conversation about one video (the video in the first user turn, text follow-ups, the
assistant turns being the model's own earlier answers, the whole history sent each turn) answers
`model.generate(do_sample=False)`'s tokens on the processor's chat template of the same history at
every turn; turns 2 and 3 reuse the earlier turns' KV (more tokens than the video's) and a forced
miss gives the same tokens. A request with a prefill-stage drop neither stores nor reuses, and
another video never hits. The bookkeeping alone: tests/unit/stages/test_prefix_cache.py."""

from __future__ import annotations

import asyncio

import pytest
import torch

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput, StageEvent
from epd.stages.messages import from_chat_template
from epd.stages.names import Stage
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions
from tests.reference import decode_for_test, reference_tokens_for_messages

NUM_FRAMES = 4
MAX_NEW_TOKENS = 8
QUESTIONS = ["what colour is the moving square?", "which way does it move?", "and how fast?"]


def ask(pipeline: Pipeline, video: bytes, history: list[dict], pruning: PruningConfig = PruningConfig()):
    """(summary, the PREFILL "finished" event) of one turn; `history` is the processor's chat form."""
    request = AskRequest(
        messages=from_chat_template(history),
        media=MediaInput(video),
        sampling=SamplingOptions(num_frames=NUM_FRAMES),
        generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        pruning=pruning,
    )

    async def run():
        return [item async for item in pipeline.ask(request)]

    items = asyncio.run(run())
    summary = next(i for i in items if isinstance(i, AskSummary))
    event = next(
        i for i in items if isinstance(i, StageEvent) and i.stage == Stage.PREFILL and i.state == "finished"
    )
    return summary, event


def user(text: str, video: bool = False) -> dict:
    return {
        "role": "user",
        "content": [*([{"type": "video"}] if video else []), {"type": "text", "text": text}],
    }


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def family(request, tiny_models):
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models[request.param])))
    yield request.param, pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def conversation(family, tiny_models, media_files):
    """The three turns through the pipeline: [(history, summary, event)], and the reference
    tokens of each turn's history."""
    name, pipeline = family
    video = media_files["mp4"].read_bytes()
    frames = decode_for_test(media_files["mp4"], NUM_FRAMES)
    history: list[dict] = []
    turns, references = [], []
    for i, question in enumerate(QUESTIONS):
        history = [*history, user(question, video=i == 0)]
        summary, event = ask(pipeline, video, history)
        turns.append((history, summary, event))
        references.append(reference_tokens_for_messages(tiny_models[name], frames, history, MAX_NEW_TOKENS))
        history = [*history, {"role": "assistant", "content": summary.answer}]
    return turns, references


def test_every_turn_equals_generate_and_the_follow_ups_reuse_the_history(family, conversation):
    _, pipeline = family
    turns, references = conversation
    for i, ((_, summary, event), reference) in enumerate(zip(turns, references, strict=True)):
        assert summary.token_ids == reference, f"turn {i + 1}"
        reused = summary.num_reused_prompt_tokens
        assert event.details["num_reused_prompt_tokens"] == str(reused)
        if i == 0:
            assert reused == 0 and event.details["prefix_cache"] == "miss"
        else:  # the whole video and the earlier turns come from the cache
            assert event.details["prefix_cache"] == "hit"
            assert summary.num_visual_tokens < reused < summary.num_prompt_tokens, f"turn {i + 1}"
            assert reused >= turns[i - 1][1].num_prompt_tokens  # all of the previous turn's prompt
    stats = pipeline.prefill.engine.prefix_cache.stats()
    assert stats.num_hits >= 2 and stats.num_entries >= 1 and stats.num_bytes > 0
    load = pipeline.prefill.load()
    assert (load.prefix_cache_hits, load.prefix_cache_entries) == (stats.num_hits, stats.num_entries)


def test_a_forced_miss_gives_the_same_tokens(family, conversation, media_files):
    _, pipeline = family
    turns, references = conversation
    history, cached, _ = turns[2]
    pipeline.prefill.engine.prefix_cache.clear()
    summary, event = ask(pipeline, media_files["mp4"].read_bytes(), history)
    assert summary.num_reused_prompt_tokens == 0 and event.details["prefix_cache"] == "miss"
    assert summary.token_ids == cached.token_ids == references[2]


def test_a_hit_does_not_write_into_the_stored_entry(family, conversation, media_files):
    """Copy-on-write: a hit continues from a copy, the entry's tensors stay as they were."""
    _, pipeline = family
    turns, _ = conversation
    cache = pipeline.prefill.engine.prefix_cache
    history = turns[1][0]
    video = media_files["mp4"].read_bytes()
    ask(pipeline, video, history)  # stored (or a hit, storing the same prompt again)
    entries = list(cache._entries.values())
    before = [(e, [t.clone() for t in e.cache.keys + e.cache.values]) for e in entries]
    summary, _ = ask(pipeline, video, [*history, {"role": "assistant", "content": "x"}, user("why?")])
    assert summary.num_reused_prompt_tokens > summary.num_visual_tokens
    for entry, saved in before:
        assert all(
            torch.equal(a, b) for a, b in zip(entry.cache.keys + entry.cache.values, saved, strict=True)
        )


def test_a_prefill_drop_request_neither_stores_nor_reuses(family, conversation, media_files):
    _, pipeline = family
    turns, _ = conversation
    cache = pipeline.prefill.engine.prefix_cache
    video = media_files["mp4"].read_bytes()
    ask(pipeline, video, turns[1][0])  # the plain request is cached
    before = cache.stats()
    drop = PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.5)
    summary, event = ask(pipeline, video, turns[2][0], drop)
    after = cache.stats()
    assert summary.num_reused_prompt_tokens == 0 and event.details["prefix_cache"] == "miss"
    assert (after.num_hits, after.num_misses, after.num_entries) == (
        before.num_hits,
        before.num_misses,
        before.num_entries,
    )


def test_another_video_never_hits(family, conversation, media_files):
    _, pipeline = family
    turns, _ = conversation
    history = turns[2][0]  # the same conversation text, about another video
    hits = pipeline.prefill.engine.prefix_cache.stats().num_hits
    summary, _ = ask(pipeline, media_files["mp4_b"].read_bytes(), history)
    assert summary.num_reused_prompt_tokens == 0
    assert pipeline.prefill.engine.prefix_cache.stats().num_hits == hits
