"""What prefill's prefix cache counts and keeps, in one process (`epd.gateway.embedded`, tiny
Qwen2-VL): the token counters on /metrics (`epd_prefix_cache_query_tokens_total` and
`epd_prefix_cache_hit_tokens_total`, vLLM's `prefix_cache_queries` and `prefix_cache_hits`)
exactly as the prompts' token ids say, a reuse shorter than `MIN_REUSE_TOKENS` neither used nor
counted, the turn that brings a video superseding its conversation's text-only entry while a
new text-only conversation with the same opening still reuses it, and a continued assistant
message whose prompt begins a cached one adding no second copy of that KV. Every answer equals
`model.generate(do_sample=False)`. The bookkeeping alone: tests/unit/stages/test_prefix_cache.py."""

from __future__ import annotations

import asyncio

import pytest

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.gateway.metrics import GatewayMetrics, MeteredPipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.prefix_cache import MIN_REUSE_TOKENS, common_prefix_length
from epd.stages.contracts import MediaInput
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.reference import (
    decode_for_test,
    reference_tokens_for_messages,
    template_reference,
    text_only_reference,
)

MAX_NEW_TOKENS = 8
NUM_FRAMES = 4
LOCAL_PREFILL = {"stage": "prefill", "core": "prefill", "replica": "local"}


def user(text: str, video: bool = False) -> dict:
    return {
        "role": "user",
        "content": [*([{"type": "video"}] if video else []), {"type": "text", "text": text}],
    }


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def stack(tiny_models):
    """(the tiny Qwen2-VL's path, the embedded pipeline with /metrics, its metrics)."""
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])))
    metrics = GatewayMetrics()
    yield tiny_models["qwen2_vl"], MeteredPipeline(pipeline, metrics), metrics
    pipeline.close()


def ask(
    pipeline,
    messages: list[dict],
    video: bytes | None = None,
    template: ChatTemplateOptions = ChatTemplateOptions(),
) -> AskSummary:
    sampling, generation = (
        SamplingOptions(num_frames=NUM_FRAMES),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
    )
    media = None if video is None else MediaInput(video)
    request = AskRequest(from_chat_template(messages), media, sampling, generation, template=template)
    return asyncio.run(request_summary(pipeline, request))


def prompt_ids(pipeline, messages: list[dict]):
    """The text-only prompt's token ids, as prefill renders it (the cache left alone)."""
    request = pipeline.prefill.engine.render(
        from_chat_template(messages),
        None,
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
        use_prefix_cache=False,
    )
    return request.prompt.input_ids[0]


def counters(metrics: GatewayMetrics) -> dict[str, float | None]:
    asyncio.run(metrics.scrape())
    names = ["query_tokens", "hit_tokens", "hits", "misses"]
    return {n: metrics.registry.get_sample_value(f"epd_prefix_cache_{n}_total", LOCAL_PREFILL) for n in names}


def test_the_counters_count_the_tokens_looked_up_and_reused(stack):
    """A prompt, the same prompt again, another conversation sharing the template's preamble
    (the default system message; 24 tokens with the tiny byte-level tokenizer, so a hit of those
    alone), and one with its own system message (a few tokens in common: no hit at all)."""
    path, pipeline, metrics = stack
    pipeline.prefill.engine.prefix_cache.clear()
    before = counters(metrics)
    first, other, own_system = (
        [user("name a colour")],
        [user("hello, who are you?")],
        [{"role": "system", "content": [{"type": "text", "text": "answer briefly"}]}, user("name a colour")],
    )
    ids = {name: prompt_ids(pipeline, m) for name, m in [("a", first), ("b", other), ("c", own_system)]}
    preamble = common_prefix_length(ids["a"], ids["b"])
    assert MIN_REUSE_TOKENS <= preamble < len(ids["b"]) - 5  # the tiny tokenizer's preamble
    assert max(common_prefix_length(ids["c"], ids[n]) for n in "ab") < MIN_REUSE_TOKENS

    assert ask(pipeline, first).num_reused_prompt_tokens == 0
    again = ask(pipeline, first)
    assert again.num_reused_prompt_tokens == len(ids["a"]) - 1
    shared = ask(pipeline, other)
    assert shared.num_reused_prompt_tokens == preamble  # the preamble's tokens, no more
    assert shared.token_ids == text_only_reference(path, other, MAX_NEW_TOKENS)
    alone = ask(pipeline, own_system)
    assert alone.num_reused_prompt_tokens == 0  # "<|im_start|>system\n" in common: not reused
    assert alone.token_ids == text_only_reference(path, own_system, MAX_NEW_TOKENS)

    after = counters(metrics)
    delta = {name: after[name] - before[name] for name in after}  # type: ignore[operator]
    assert delta == {
        "query_tokens": 2 * len(ids["a"]) + len(ids["b"]) + len(ids["c"]),
        "hit_tokens": (len(ids["a"]) - 1) + preamble,
        "hits": 2,
        "misses": 2,
    }


def test_the_turn_that_brings_the_video_supersedes_the_text_turns_entry(stack, media_files):
    """Text first, then the video: the video turn reuses the text turn's KV and its entry takes
    the text turn's place (one entry, not two). A new text-only conversation with the same
    opening reuses that entry's text before the video, further than the text turn's entry held,
    and answers as generate() does."""
    path, pipeline, _ = stack
    cache = pipeline.prefill.engine.prefix_cache
    cache.clear()
    opening = [user("I will show you a clip")]
    conversation = [*opening, assistant("ok, send it"), user("what moves?", video=True)]
    video = media_files["mp4"].read_bytes()
    text_turn = ask(pipeline, opening)
    video_turn = ask(pipeline, conversation, video)
    assert video_turn.num_reused_prompt_tokens >= text_turn.num_prompt_tokens
    frames = decode_for_test(media_files["mp4"], NUM_FRAMES)
    assert video_turn.token_ids == reference_tokens_for_messages(path, frames, conversation, MAX_NEW_TOKENS)
    stats = cache.stats()
    assert (stats.num_entries, stats.num_evictions) == (1, 0)
    (entry,) = cache._entries.values()
    assert entry.num_tokens == video_turn.num_prompt_tokens and stats.num_bytes == entry.num_bytes

    # Another conversation, text only: the same opening and the same first answer, then another
    # question. It reuses the video turn's entry up to its own question.
    other = [*opening, assistant("ok, send it"), user("never mind, name a colour")]
    reused = ask(pipeline, other)
    other_ids = prompt_ids(pipeline, other)
    assert reused.num_reused_prompt_tokens == common_prefix_length(other_ids, entry.token_ids)
    assert reused.num_reused_prompt_tokens > text_turn.num_prompt_tokens
    assert reused.token_ids == text_only_reference(path, other, MAX_NEW_TOKENS)


def test_a_continued_message_whose_prompt_begins_a_cached_one_keeps_one_copy(stack):
    """The assistant's partial answer answered after (the defaults: the prompt closes it and opens
    a new turn), then continued (`continue_final_message`: the same prompt cut at the open
    message, a strict prefix of the first). The second reuses all but its last token of the
    first's entry and adds no entry of its own: that entry already holds its KV, and a second
    copy would take the byte budget from other conversations. Both answer as generate() does."""
    path, pipeline, _ = stack
    cache = pipeline.prefill.engine.prefix_cache
    cache.clear()
    messages = [user("name a colour"), assistant("The colour is")]
    answered = ask(pipeline, messages)
    (entry,) = cache._entries.values()
    continued = ask(pipeline, messages, template=ChatTemplateOptions(False, True))
    prompt, want = template_reference(
        path, messages, MAX_NEW_TOKENS, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.token_ids == want and continued.num_prompt_tokens == len(prompt)
    assert entry.token_ids[: len(prompt)].tolist() == prompt and answered.num_prompt_tokens > len(prompt)
    assert continued.num_reused_prompt_tokens == len(prompt) - 1
    stats = cache.stats()
    assert (stats.num_entries, stats.num_bytes) == (1, entry.num_bytes)
    assert next(iter(cache._entries.values())) is entry
