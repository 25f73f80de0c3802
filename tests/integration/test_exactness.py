"""With every lossy option off, the split pipeline yields exactly `generate(do_sample=False)`'s
tokens: (a) in one process through the stage contracts, (b) through three service processes."""

from __future__ import annotations

import asyncio

import pytest

from epd.client import EpdClient
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from tests.embedded import ask_tokens
from tests.reference import (
    decode_for_test,
    divergence_margin,
    reference_tokens,
    reference_tokens_for_messages,
)
from tests.stack import Stack

QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 20
CASES = [
    ("qwen2_vl", "mp4", 8),
    ("qwen2_vl", "mp4", 64),
    ("qwen2_vl", "png", 1),
    ("qwen2_5_vl", "mp4", 8),
    ("qwen2_5_vl", "mp4", 64),
    ("qwen2_5_vl", "png", 1),
]


@pytest.fixture(scope="module")
def stacks(tiny_models, tmp_path_factory, shared_stack):
    """Qwen2-VL's is the session's shared stack (default flags, as here): one stack fewer to start."""
    with Stack(tiny_models["qwen2_5_vl"], tmp_path_factory.mktemp("logs_q25")) as b:
        yield {"qwen2_vl": shared_stack, "qwen2_5_vl": b}


@pytest.fixture(scope="module")
def references(tiny_models, media_files):
    out = {}
    for family, media, num_frames in CASES:
        video = decode_for_test(media_files[media], num_frames)
        out[(family, media, num_frames)] = reference_tokens(
            tiny_models[family], video, QUESTION, MAX_NEW_TOKENS
        )
    return out


def embedded_tokens(model_dir, path, num_frames: int, positions_override=None) -> list[int]:
    with build_embedded_pipeline(ModelConfig(model=str(model_dir))) as pipeline:
        if positions_override is not None:
            adapter = pipeline.prefill.engine.adapter
            adapter._prompt_positions = positions_override.__get__(adapter)
        return asyncio.run(ask_tokens(pipeline, path, QUESTION, num_frames, MAX_NEW_TOKENS))


@pytest.mark.parametrize("family,media,num_frames", CASES)
def test_reference_output_varies(references, family, media, num_frames):
    ref = references[(family, media, num_frames)]
    assert len(ref) >= 16, "the reference stopped early; the comparison would prove little"
    assert len(set(ref)) > 4, "the tiny model repeats one token; raise its weight scale"


@pytest.mark.parametrize("family,media,num_frames", CASES)
def test_in_process_split_equals_generate(tiny_models, media_files, references, family, media, num_frames):
    got = embedded_tokens(tiny_models[family], media_files[media], num_frames)
    assert got == references[(family, media, num_frames)]


@pytest.mark.parametrize("family,media,num_frames", CASES)
def test_three_services_equal_generate(stacks, media_files, references, family, media, num_frames):
    with EpdClient(stacks[family].gateway) as client:
        result = client.ask(
            media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS
        )
    assert result.token_ids == references[(family, media, num_frames)]
    expected_frames = 1 if media == "png" else num_frames
    assert result.num_frames == expected_frames
    assert result.kv_num_bytes > 0
    assert {"decode", "encode", "prefill", "kv_transfer", "ttft", "total"} <= set(result.timings_ms)


def test_wrong_positions_break_equality(tiny_models, media_files, references):
    """Negative control: plain 1-D positions instead of M-RoPE must change the tokens."""
    import torch

    def flat_positions(self, input_ids, visual):
        length = input_ids.shape[1]
        return torch.arange(length).view(1, 1, -1).expand(4, 1, length).clone()

    got = embedded_tokens(tiny_models["qwen2_vl"], media_files["mp4"], 8, positions_override=flat_positions)
    assert got != references[("qwen2_vl", "mp4", 8)]


# Requests that run in one decode batch: different frame counts (prompt lengths) and media, joining
# while others run (staggered starts) and leaving mid-batch (different max_new_tokens).
BATCH = [("mp4", 64, 20, 0.0), ("mp4", 8, 7, 0.0), ("png", 1, 13, 0.05), ("mp4", 8, 20, 0.3)]
NEAR_TIE_LOGITS = 1e-3
"""Largest logit margin between generate()'s token and ours that counts as a rounding near-tie."""


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_batch_of_different_requests_equals_generate_request_by_request(
    stacks, tiny_models, media_files, references, family
):
    """Each request's greedy tokens inside the decode batch equal generate()'s for it alone; where
    one differs, it must be a near-tie of the reference model (shown, not hidden)."""
    from epd.client import AsyncEpdClient

    async def one(client, media, num_frames, max_new, delay_s):
        await asyncio.sleep(delay_s)
        r = await client.ask(media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=max_new)
        return r.token_ids

    async def run():
        async with AsyncEpdClient(stacks[family].gateway) as client:
            return await asyncio.gather(*(one(client, *case) for case in BATCH))

    assert_batch_equals_generate_or_near_ties(
        tiny_models[family], media_files, references, family, asyncio.run(run())
    )


def assert_batch_equals_generate_or_near_ties(model_dir, media_files, references, family, got) -> None:
    """Each of BATCH's requests' tokens equal generate()'s for it alone, or leave them at a near-tie."""
    for (media, num_frames, max_new, _), tokens in zip(BATCH, got, strict=True):
        want = references[(family, media, num_frames)][:max_new]
        margin = divergence_margin(
            model_dir, decode_for_test(media_files[media], num_frames), QUESTION, want, tokens
        )
        assert margin is None or margin[1] <= NEAR_TIE_LOGITS, (
            f"{media} x {num_frames} frames: token {margin and margin[0]} differs from generate()'s by a "
            f"logit margin of {margin and margin[1]}: not a rounding near-tie"
        )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_batch_in_one_process_with_steps_side_by_side_equals_generate_request_by_request(
    tiny_models, media_files, references, family
):
    """The colocated server's pipeline (one model, encode/prefill and decode steps at once on two
    model threads by default): the same batch, the same rule as through three processes."""
    from epd.gateway.config import SharedModelSchedule

    assert SharedModelSchedule().concurrent_steps == 2  # what this test is about
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models[family]))) as pipeline:

        async def run():
            return await asyncio.gather(
                *(ask_tokens(pipeline, media_files[m], QUESTION, f, n, delay_s) for m, f, n, delay_s in BATCH)
            )

        got = asyncio.run(run())
    assert_batch_equals_generate_or_near_ties(tiny_models[family], media_files, references, family, got)


# -- conversations: a prefix-cache hit and a forced miss through three processes (issue #15) ----

TURNS = ["describe the clip", "what moves?", "in which direction?"]
CONVERSATION_FRAMES = 8


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_three_turn_conversation_equals_generate_on_a_hit_and_on_a_forced_miss(
    stacks, tiny_models, media_files, tmp_path, family
):
    """The SDK's conversation sends each turn's whole history: turns 2-3 reuse the earlier turns'
    prefill (prefix-cache hits) and each equals generate() on that history. The same last turn about
    a byte-different copy of the clip (same frames, another sha256: nothing cached) gives the same
    tokens: a hit and a miss agree."""
    from epd.bench.bench_conversation import remux_copy

    video = decode_for_test(media_files["mp4"], CONVERSATION_FRAMES)
    history: list[dict] = []
    prompt_tokens: list[int] = []  # each turn's
    with EpdClient(stacks[family].gateway, timeout_s=120) as client:
        chat = client.conversation(
            media_files["mp4"], num_frames=CONVERSATION_FRAMES, max_new_tokens=MAX_NEW_TOKENS
        )
        for turn, question in enumerate(TURNS):
            result = chat.ask(question)
            history.append({"role": "user", "content": [*([{"type": "video"}] if turn == 0 else []),
                                                        {"type": "text", "text": question}]})  # fmt: skip
            want = reference_tokens_for_messages(tiny_models[family], video, history, MAX_NEW_TOKENS)
            assert result.token_ids == want, f"turn {turn + 1}"
            if turn > 0:  # the whole earlier prompt is reused (turn 1 may reuse the video's part of
                # another question's prompt asked before in this module: prefixes are shared)
                assert result.num_reused_prompt_tokens == prompt_tokens[-1], f"turn {turn + 1}"
                assert result.num_reused_prompt_tokens > result.num_visual_tokens
            prompt_tokens.append(result.num_prompt_tokens)
            history.append({"role": "assistant", "content": result.answer})
        copy = remux_copy(media_files["mp4"], tmp_path / "copy.mp4", tag="forced miss")
        assert copy.read_bytes() != media_files["mp4"].read_bytes()
        missed = client.ask(
            copy, messages=history[:-1], num_frames=CONVERSATION_FRAMES, max_new_tokens=MAX_NEW_TOKENS
        )
    assert missed.num_reused_prompt_tokens == 0 and not missed.encoder_cache_hit
    assert missed.token_ids == result.token_ids
