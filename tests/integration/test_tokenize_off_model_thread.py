"""Prefill answers /tokenize and /detokenize off its model thread, with a tokenizer of its own.

A /tokenize used to run on the model thread: it waited for the prefill step in progress, and a
flood of them took model time from prefill (docs/benchmarks.md, "/tokenize"). Now it runs on the
stage's tokenizer thread with the engine's copy of the tokenizer and processor, so it answers while
the model thread is busy, and its ids are still exactly the prompt's (real tiny Qwen2-VL, real
processor and fast tokenizer).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.messages import from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.tokenize import TokenizeInput
from tests.families import family_checkpoints

HANG_GUARD_S = 60.0
"""Only ends a test that would otherwise wait forever (a call stuck behind the held model thread)."""


def _conversation(question: str) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
        {"role": "user", "content": [{"type": "text", "text": question}]},
    ]


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "prefill")


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("tokenizing_copy_models"))


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "llava_onevision"]
)
def test_the_tokenizing_copy_owns_its_tokenizer_and_gives_the_same_ids(checkpoints, family):
    """Shared with the model thread's, a fast tokenizer may refuse a concurrent call ("Already
    borrowed"): the copy's tokenizer and processor are its own, the processor's tokenizer is the
    copy's tokenizer, the model is shared, not copied, and every family's copy gives the ids the
    adapter gives (a conversation's are its text-only prompt's)."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    twin = adapter.tokenizing_copy()
    assert twin.tokenizer is not adapter.tokenizer and twin.processor is not adapter.processor
    assert twin.processor.tokenizer is twin.tokenizer
    assert twin.model is adapter.model
    conversation = _conversation("what colour is the sky?")
    prompt_ids = adapter.build_prompt(conversation, None).input_ids[0].tolist()
    assert twin.tokenize_conversation(conversation, True, False) == prompt_ids
    assert twin.tokenize("a red circle", True) == adapter.tokenize("a red circle", True)
    assert twin.decode_tokens(prompt_ids) == adapter.decode_tokens(prompt_ids)


@pytest.mark.parametrize(
    "family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "llava_onevision"]
)
def test_every_family_continues_a_final_message_and_names_its_tokens_as_its_processor(checkpoints, family):
    """/tokenize's continue_final_message and return_token_strs in every family: the ids of the
    family's own processor's rendering with the last message left open, and its tokenizer's
    tokens of them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoints[family]))
    twin = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill").tokenizing_copy()
    conversation = [
        *_conversation("what colour is the sky?"),
        {"role": "assistant", "content": [{"type": "text", "text": "The sky is"}]},
    ]
    rendered = processor.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert rendered.endswith("The sky is")
    ids = twin.tokenize_conversation(conversation, False, False, True)
    assert ids == processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert twin.token_strings(ids) == processor.tokenizer.convert_ids_to_tokens(ids)


def test_tokenize_answers_while_the_model_thread_is_busy(adapter):
    """A /tokenize and a /detokenize complete while a model call holds the model thread."""
    model_thread = ModelThread()
    stage = LocalPrefillStage(PrefillEngine(PrefillConfig(), adapter), KvStore(1 << 30, 600.0), model_thread)
    release = threading.Event()

    async def scenario() -> tuple[list[int], str, bool]:
        held = asyncio.ensure_future(model_thread.run(release.wait))
        try:
            request = TokenizeInput(
                messages=from_chat_template(_conversation("a red circle moves left")),
                add_special_tokens=False,
            )
            ids = (await asyncio.wait_for(stage.tokenize(request, "t"), HANG_GUARD_S)).token_ids
            text = await asyncio.wait_for(stage.detokenize(ids, "d"), HANG_GUARD_S)
            return ids, text, held.done()
        finally:
            release.set()
            await held
            await stage.close()

    try:
        ids, text, model_call_done = asyncio.run(scenario())
    finally:
        release.set()
        model_thread.close()
    assert not model_call_done  # both answered while the model thread was still held
    assert ids and "a red circle moves left" in text


def test_concurrent_tokenize_calls_during_prefill_give_the_prompts_ids(adapter, processor):
    """Many /tokenize and /detokenize calls at once, while text prompts are prepared (tokenised on
    the model thread) and prefilled: each answer is exactly what the tokenizer gives alone, and no
    call fails (a tokenizer shared between the threads may refuse one: "Already borrowed")."""
    model_thread = ModelThread()
    stage = LocalPrefillStage(PrefillEngine(PrefillConfig(), adapter), KvStore(1 << 30, 600.0), model_thread)
    questions = [f"question {i}: " + " ".join(f"word{j}" for j in range(40 * (i + 1))) for i in range(8)]
    expected = [
        processor.tokenizer(
            processor.apply_chat_template(_conversation(q), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]

    async def scenario():
        prefills = [
            stage.prefill(
                from_chat_template(_conversation(q)), None, GenerationConfig(max_new_tokens=1), f"p{i}"
            )
            for i, q in enumerate(questions)
        ]
        tokenizes = [
            stage.tokenize(
                TokenizeInput(messages=from_chat_template(_conversation(q)), add_special_tokens=False),
                f"t{i}",
            )
            for _ in range(3)
            for i, q in enumerate(questions)
        ]
        detokenizes = [stage.detokenize(ids, f"d{i}") for i, ids in enumerate(expected)]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*prefills, *tokenizes, *detokenizes), HANG_GUARD_S * 5
            )
            n, m = len(prefills), len(tokenizes)
            handles, ids, texts = results[:n], results[n : n + m], results[n + m :]
            for handle in handles:
                await stage.release(handle, "done")
            return handles, ids, texts
        finally:
            await stage.close()  # the core's loop runs on this event loop

    try:
        handles, ids, texts = asyncio.run(scenario())
    finally:
        model_thread.close()
    assert [h.num_prompt_tokens for h in handles] == [len(e) for e in expected]  # prepare's ids too
    assert [out.token_ids for out in ids] == expected * 3
    assert texts == [processor.tokenizer.decode(e) for e in expected]
