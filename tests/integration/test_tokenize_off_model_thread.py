"""Prefill renders prompts and answers /tokenize and /detokenize off its model thread, with the
model's one tokenizer.

A /tokenize used to run on the model thread: it waited for the prefill step in progress, and a
flood of them took model time from prefill (docs/benchmarks.md, "/tokenize"). Prompts were rendered
(chat template, tokenisation) there too, so a slow chat template held every prefill. Both now run
on the stage's tokenizer threads, so they go on while the model thread is busy, and a slow
template holds only its own request. The threads share the one tokenizer: no call of ours changes
the tokenizer's truncation/padding settings once the engine settled them
(`VLMAdapter.settle_tokenizer`), so the threads only read it, and prefill keeps no second copy
(46-141 MiB with a Qwen2-sized vocabulary). A change while another thread encodes would alter that
call's ids (or, before tokenizers 0.23.1, fail itself: "Already borrowed"). Real tiny models of
every family, real processors and fast tokenizers.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from epd.model_runtime.adapter import RenderOptions
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREAD_NAME, TOKENIZER_THREAD_NAME, LocalPrefillStage
from epd.stages.deadline import set_client_deadline
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.raw_prompt import RawPrompt
from epd.stages.tokenize import TokenizeInput
from tests.families import FAMILIES, family_checkpoints, load_video, visual_meta

T = TypeVar("T")

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
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("tokenize_family_models"))


def _live_tokenizers() -> int:
    """Rust tokenizers alive in this process (`tokenizers.Tokenizer`: what a copy of a fast
    tokenizer adds, its vocabulary and merges with it)."""
    from tokenizers import Tokenizer

    gc.collect()
    return sum(isinstance(o, Tokenizer) for o in gc.get_objects())


def _backend_settings(adapter) -> tuple:
    """What transformers changes on the Rust tokenizer when a call asks for other settings."""
    backend = adapter.tokenizer.backend_tokenizer
    return backend.truncation, backend.padding, backend.encode_special_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_keeps_one_tokenizer_that_no_call_changes(checkpoints, family):
    """The engine adds no tokenizer to the process (it kept a deep copy for /tokenize), and no
    call that prefill's two threads make (the model thread's prompts, /tokenize's and
    /detokenize's) changes the tokenizer's settings, so that they may run at once: every family's
    tokenizer is left as the engine settled it, and the ids are the adapter's."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    before = _live_tokenizers()
    engine = PrefillEngine(PrefillConfig(), adapter)
    assert _live_tokenizers() == before
    settled = _backend_settings(adapter)
    conversation = _conversation("what colour is the sky?")
    prompt_ids = adapter.build_prompt(conversation, None).input_ids[0].tolist()
    open_turn = [*conversation, {"role": "assistant", "content": [{"type": "text", "text": "The sky"}]}]
    calls = {
        "build_prompt": lambda: adapter.build_prompt(conversation, None),
        "build_raw_prompt": lambda: adapter.build_raw_prompt("a red circle"),
        "detokenize": lambda: adapter.detokenize(prompt_ids),
        "tokenize": lambda: engine.tokenize(TokenizeInput(prompt="a red circle", return_token_strs=True)),
        "tokenize messages": lambda: engine.tokenize(
            TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False)
        ),
        "tokenize continued": lambda: engine.tokenize(
            TokenizeInput(
                messages=from_chat_template(open_turn),
                add_special_tokens=False,
                template=ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True),
            )
        ),
        "detokenize route": lambda: engine.detokenize(prompt_ids),
    }
    for name, call in calls.items():
        call()
        assert _backend_settings(adapter) == settled, f"{name} changed the tokenizer's settings"
    request = TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False)
    assert engine.tokenize(request).token_ids == prompt_ids


def test_a_tokenizer_json_with_truncation_and_padding_is_settled_before_a_second_thread(
    tiny_models, tmp_path
):
    """A checkpoint whose tokenizer.json sets truncation and padding (transformers' load turns
    them on): the first call of ours turns them off again, a change that must not happen while
    another thread encodes. The engine makes it at construction, so the settings it leaves are
    those every later call asks for, and the ids are transformers' (neither truncated nor padded)."""
    model = shutil.copytree(tiny_models["qwen2_vl"], tmp_path / "model")
    tokenizer_json = json.loads((model / "tokenizer.json").read_text())
    tokenizer_json["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    tokenizer_json["padding"] = {
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>",
    }  # fmt: skip
    (model / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    adapter = load_adapter(ModelConfig(model=str(model)), "prefill")
    backend = adapter.tokenizer.backend_tokenizer
    assert backend.truncation is not None and backend.padding is not None  # as loaded
    engine = PrefillEngine(PrefillConfig(), adapter)
    assert backend.truncation is None and backend.padding is None
    text = "a red circle moves left and a blue square moves right"
    ids = engine.tokenize(TokenizeInput(prompt=text, add_special_tokens=False)).token_ids
    assert backend.truncation is None and backend.padding is None
    assert ids == adapter.tokenizer(text, add_special_tokens=False)["input_ids"] and len(ids) > 4


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_continues_a_final_message_and_names_its_tokens_as_its_processor(checkpoints, family):
    """/tokenize's continue_final_message and return_token_strs in every family: the ids of the
    family's own processor's rendering with the last message left open, and its tokenizer's
    tokens of them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoints[family]))
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    conversation = [
        *_conversation("what colour is the sky?"),
        {"role": "assistant", "content": [{"type": "text", "text": "The sky is"}]},
    ]
    rendered = processor.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert rendered.endswith("The sky is")
    ids = adapter.tokenize_conversation(
        conversation, False, RenderOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert ids == processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert adapter.token_strings(ids) == processor.tokenizer.convert_ids_to_tokens(ids)


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


class _HeldEncode:
    """transformers' Rust tokenizer (a fast tokenizer's `_tokenizer`) behind a stand-in that holds
    the first encode after it is installed (a prefill's prompt) at its start, until `release`:
    transformers has applied that call's truncation/padding settings, and its encode has not run.
    A change of settings by another thread now would reach that encode. Every other call and
    attribute goes to the tokenizer."""

    def __init__(self, backend) -> None:
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "entered", threading.Event())
        object.__setattr__(self, "release", threading.Event())

    def encode_batch(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it
        return self._backend.encode_batch(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._backend, name, value)


def test_tokenize_runs_to_the_end_while_a_prompt_is_inside_its_tokenisation(adapter, processor):
    """The race a tokenizer shared by several threads could lose, made to happen: a prefill's
    prompt is held inside its tokenisation (`render`), between transformers applying the call's
    settings and the encode, while /tokenize and /detokenize calls run on the same tokenizer. They
    answer without waiting for it (no lock), with the tokenizer's ids; when the prompt's encode
    goes on, it is still exactly the tokenizer's (no /tokenize call changed the settings its encode
    runs with), and it prefills."""
    model_thread = ModelThread()
    stage = LocalPrefillStage(PrefillEngine(PrefillConfig(), adapter), KvStore(1 << 30, 600.0), model_thread)
    question = "a red circle moves left, " * 40
    conversation = _conversation(question)
    expected = processor.tokenizer(
        processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    expected_raw = processor.tokenizer(question)["input_ids"]
    backend = adapter.tokenizer._tokenizer
    held = _HeldEncode(backend)

    async def scenario():
        prefill = asyncio.ensure_future(
            stage.prefill(from_chat_template(conversation), None, GenerationConfig(max_new_tokens=1), "p")
        )
        try:
            assert await asyncio.to_thread(held.entered.wait, HANG_GUARD_S)  # the prompt's encode is held
            answers = await asyncio.wait_for(
                asyncio.gather(
                    stage.tokenize(
                        TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False),
                        "t",
                    ),
                    stage.tokenize(TokenizeInput(prompt=question, return_token_strs=True), "s"),
                    stage.detokenize(expected, "d"),
                ),
                HANG_GUARD_S,
            )
            prompt_was_held = not prefill.done()
        finally:
            held.release.set()
        handle = await asyncio.wait_for(prefill, HANG_GUARD_S)
        await stage.release(handle, "done")
        await stage.close()
        return answers, prompt_was_held, handle

    adapter.tokenizer._tokenizer = held
    try:
        (chat, raw, text), prompt_was_held, handle = asyncio.run(scenario())
    finally:
        adapter.tokenizer._tokenizer = backend
        held.release.set()
        model_thread.close()
    assert prompt_was_held  # every /tokenize answered while the prompt's tokenisation was held
    assert chat.token_ids == expected
    assert raw.token_ids == expected_raw
    assert raw.token_strs == processor.tokenizer.convert_ids_to_tokens(expected_raw)
    assert text == processor.tokenizer.decode(expected)
    assert handle.num_prompt_tokens == len(expected)  # the held encode ran with the settings it asked for


def test_concurrent_tokenize_calls_during_prefill_give_the_prompts_ids(adapter, processor):
    """The race a shared tokenizer could lose: many /tokenize and /detokenize calls at once on the
    tokenizer threads while long chat and raw prompts are tokenised (`render`, on those threads
    too) and prefilled, all with the one tokenizer. Every answer and every prompt's length is exactly
    what the tokenizer gives alone, and no call fails (a call that changed the tokenizer's settings
    while the other thread encodes would alter that one's ids, or fail itself: "Already borrowed")."""
    model_thread = ModelThread()
    config = PrefillConfig(scheduler=PrefillSchedulerConfig(max_waiting_prefills=1024))  # all queue at once
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    # Long prompts (the threads' encodes overlap) and many short ones (prompts are tokenised
    # often, with /tokenize's calls in between).
    lengths_words = [150 * (i + 1) for i in range(8)] + [10 + i % 20 for i in range(56)]
    questions = [
        f"question {i}: " + " ".join(f"word{j}" for j in range(n)) for i, n in enumerate(lengths_words)
    ]
    expected = [
        processor.tokenizer(
            processor.apply_chat_template(_conversation(q), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]
    expected_raw = [processor.tokenizer(q)["input_ids"] for q in questions]  # special tokens added

    async def scenario():
        prefills = [
            call
            for i, q in enumerate(questions)
            for call in (
                stage.prefill(
                    from_chat_template(_conversation(q)), None, GenerationConfig(max_new_tokens=1), f"p{i}"
                ),
                stage.prefill([], None, GenerationConfig(max_new_tokens=1), f"r{i}", raw_prompt=RawPrompt(q)),
            )
        ]
        tokenizes = [
            stage.tokenize(
                TokenizeInput(messages=from_chat_template(_conversation(q)), add_special_tokens=False),
                f"t{i}",
            )
            for _ in range(2)
            for i, q in enumerate(questions)
        ]
        raw_tokenizes = [
            stage.tokenize(TokenizeInput(prompt=q, return_token_strs=True), f"s{i}")
            for i, q in enumerate(questions)
        ]
        detokenizes = [stage.detokenize(ids, f"d{i}") for i, ids in enumerate(expected)]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*prefills, *tokenizes, *raw_tokenizes, *detokenizes), HANG_GUARD_S * 5
            )
            n, m, r = len(prefills), len(tokenizes), len(raw_tokenizes)
            handles = results[:n]
            for handle in handles:
                await stage.release(handle, "done")
            return handles, results[n : n + m], results[n + m : n + m + r], results[n + m + r :]
        finally:
            await stage.close()  # the core's loop runs on this event loop

    try:
        handles, ids, raw_ids, texts = asyncio.run(scenario())
    finally:
        model_thread.close()
    lengths = [n for e, r in zip(expected, expected_raw) for n in (len(e), len(r))]
    assert [h.num_prompt_tokens for h in handles] == lengths  # the model thread's prompts
    assert [out.token_ids for out in ids] == expected * 2
    assert [out.token_ids for out in raw_ids] == expected_raw
    assert [out.token_strs for out in raw_ids] == [
        processor.tokenizer.convert_ids_to_tokens(e) for e in expected_raw
    ]
    assert texts == [processor.tokenizer.decode(e) for e in expected]


SLOW_TEMPLATE = (
    "{% for i in range(20000) %}{% endfor %}"  # a loop of the template's own (the gate below holds it longer)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content[-1].text }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hold_slow_renders(adapter, rendering: threading.Event, release: threading.Event) -> None:
    """Make `adapter` hold each render with `SLOW_TEMPLATE` at its start (setting `rendering`) until
    `release`; `del adapter._render` undoes it."""
    render = adapter._render

    def held_render(conversation, options):
        if options.chat_template == SLOW_TEMPLATE:
            rendering.set()
            release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it
        return render(conversation, options)

    adapter._render = held_render


@contextlib.contextmanager
def _slow_renders_held(adapter, rendering, release: threading.Event, model_thread: ModelThread):
    """`_hold_slow_renders` for the block; after it, the class's render again, every held render
    let go, and `model_thread` closed."""
    _hold_slow_renders(adapter, rendering, release)
    try:
        yield
    finally:
        del adapter._render  # the class's method again
        release.set()
        model_thread.close()


async def _served_meanwhile(stage: LocalPrefillStage, conversation: list[dict]):
    """A prefill and a /tokenize of `conversation` with the server's template, each within the hang guard."""
    fast = await asyncio.wait_for(
        stage.prefill(from_chat_template(conversation), None, GenerationConfig(max_new_tokens=1), "f"),
        HANG_GUARD_S,
    )
    counted = await asyncio.wait_for(
        stage.tokenize(
            TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False), "t"
        ),
        HANG_GUARD_S,
    )
    return fast, counted


def test_a_slow_chat_template_holds_no_other_requests_prefill(adapter, processor):
    """A trusted request's own chat template that renders for a long time (here: held inside its
    rendering until the test lets it go) does not delay another request: that one is rendered,
    prefilled and answered while the first is still rendering, on another thread than the model
    thread (when prompts rendered on the model thread, the second waited for the first's template;
    with one render thread, too). A /tokenize answers meanwhile. Then the slow one finishes, its
    prompt exactly the processor's rendering with that template."""
    model_thread = ModelThread()
    config = PrefillConfig(trust_request_chat_template=True)
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    slow_conversation = _conversation("what colour is the circle?")
    fast_conversation = _conversation("a red circle moves left")
    expected_slow = processor.tokenizer(
        processor.apply_chat_template(
            slow_conversation, chat_template=SLOW_TEMPLATE, add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )["input_ids"]
    expected_fast = processor.tokenizer(
        processor.apply_chat_template(fast_conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    rendering, release = threading.Event(), threading.Event()

    async def scenario():
        slow = asyncio.ensure_future(
            stage.prefill(
                from_chat_template(slow_conversation),
                None,
                GenerationConfig(max_new_tokens=1),
                "slow",
                template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
            )
        )
        try:
            assert await asyncio.to_thread(rendering.wait, HANG_GUARD_S)  # the slow one is rendering
            fast, counted = await _served_meanwhile(stage, fast_conversation)
            slow_was_rendering = not slow.done()
        finally:
            release.set()
        slow_handle = await asyncio.wait_for(slow, HANG_GUARD_S)
        for handle in (fast, slow_handle):
            await stage.release(handle, "done")
        await stage.close()
        return fast, counted, slow_was_rendering, slow_handle

    with _slow_renders_held(adapter, rendering, release, model_thread):
        fast, counted, slow_was_rendering, slow_handle = asyncio.run(scenario())
    assert slow_was_rendering  # the other request was answered while the slow template rendered
    assert fast.num_prompt_tokens == len(expected_fast) and counted.token_ids == expected_fast
    assert slow_handle.num_prompt_tokens == len(expected_slow)


def test_closing_the_tokenizer_threads_waits_for_a_held_render_only_up_to_the_bound(
    adapter, monkeypatch, caplog
):
    """A render that does not end (a trusted request's own chat template that loops; here held
    until the test lets it go) does not hold the close: `close_tokenizer`, as `epd serve prefill`
    and the embedded pipeline call it at shutdown, waits up to `CLOSE_WAIT_S` (made short here)
    and names the thread it leaves in a WARNING. Before, prefill's server waited for it without a
    bound and the embedded pipeline did not wait at all. The render is still held when the close
    returns: no time is measured."""
    from epd.prefill_svc import stage as stage_module

    monkeypatch.setattr(stage_module, "CLOSE_WAIT_S", 0.2, raising=False)
    model_thread = ModelThread()
    config = PrefillConfig(trust_request_chat_template=True)
    stage = LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)
    rendering, release = threading.Event(), threading.Event()

    async def scenario() -> bool:
        held = asyncio.ensure_future(
            stage.tokenize(
                TokenizeInput(
                    messages=from_chat_template(_conversation("what colour is the circle?")),
                    template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
                ),
                "held",
            )
        )
        try:
            assert await asyncio.to_thread(rendering.wait, HANG_GUARD_S)
            with caplog.at_level(logging.WARNING, logger=stage_module.__name__):
                await asyncio.wait_for(asyncio.to_thread(stage.close_tokenizer), HANG_GUARD_S)
            return not held.done()
        finally:
            release.set()
            await asyncio.wait_for(held, HANG_GUARD_S)
            await stage.close()

    with _slow_renders_held(adapter, rendering, release, model_thread):
        still_rendering = asyncio.run(scenario())
    assert still_rendering  # the close returned while the render was held
    left = [
        r for r in caplog.records if r.levelno == logging.WARNING and "still render after close" in r.message
    ]
    assert len(left) == 1 and REQUEST_TEMPLATE_THREAD_NAME in left[0].message  # the request's template's


def test_closing_an_embedded_pipeline_waits_for_all_its_parts_within_one_bound(tiny_models, caplog):
    """An embedded pipeline's close waits for its parts in turn against one deadline, its
    `close_timeout_s` (`--close-timeout-s`; made short here): with a render held in a tokenizer thread (a looping trusted
    chat template) and a call held on the model thread, the model threads' close gets what the
    tokenizer threads' wait left of it, nothing, where each part had its own bound one after
    another (the encoder's 5 s, the tokenizer's 30 s, the model's 30 s: 65 s at worst). The close
    returns with both still held, and names both in warnings. The waits each part was given are
    recorded, not timed."""
    from epd.gateway.embedded import build_embedded_pipeline

    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])), close_timeout_s=0.2)
    started = threading.Semaphore(0)
    release = threading.Event()

    def held() -> None:
        started.release()
        release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it

    given: dict[str, tuple] = {}

    def recorded(name: str, close):
        def close_and_record(*args):
            given[name] = args
            return close(*args)

        return close_and_record

    try:
        pipeline.prefill._tokenizer_pool.submit(held)  # what a looping chat template does to its thread
        threading.Thread(target=pipeline.model_thread.call, args=(held,), daemon=True).start()
        assert started.acquire(timeout=HANG_GUARD_S) and started.acquire(timeout=HANG_GUARD_S)
        pipeline.prefill.close_tokenizer = recorded("tokenizer", pipeline.prefill.close_tokenizer)
        pipeline.model_thread.close = recorded("model", pipeline.model_thread.close)
        with caplog.at_level(logging.WARNING):
            pipeline.close()
        still_held = not release.is_set()
    finally:
        release.set()
    assert still_held
    assert 0 < given["tokenizer"][0] <= 0.2
    assert given["model"] == (0.0,)  # the held render took all of the one bound
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(TOKENIZER_THREAD_NAME in w and "still render after close" in w for w in warned), warned
    assert any("model_0" in w and "still run a call after close" in w for w in warned), warned


class _Entered:
    """Stands for `_hold_slow_renders`' event: counts the renders that entered, each a release."""

    def __init__(self) -> None:
        self.renders = threading.Semaphore(0)
        self.num_renders = 0

    def set(self) -> None:
        self.num_renders += 1
        self.renders.release()

    def wait_for(self, num_renders: int) -> bool:
        return all(self.renders.acquire(timeout=HANG_GUARD_S) for _ in range(num_renders))


def _trusting_stage(adapter, model_thread: ModelThread) -> LocalPrefillStage:
    config = PrefillConfig(trust_request_chat_template=True)
    return LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)


def _with_client_deadline(call: Callable[[], Awaitable[T]], deadline_s: float | None) -> asyncio.Future[T]:
    """`call()` in a task of its own with the client deadline `deadline_s` (time.monotonic();
    None: none) set for it, as the prefill servicer sets its gRPC call's (`epd.stages.deadline`)."""

    async def run() -> T:
        if deadline_s is not None:
            set_client_deadline(deadline_s - time.monotonic())
        return await call()

    return asyncio.ensure_future(run())


def _slow_prefill(stage: LocalPrefillStage, request_id: str, deadline_s: float | None = None):
    return _with_client_deadline(
        lambda: stage.prefill(
            from_chat_template(_conversation("what colour is the circle?")),
            None,
            GenerationConfig(max_new_tokens=1),
            request_id,
            template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
        ),
        deadline_s,
    )


def test_requests_own_templates_never_hold_every_render_thread(adapter, processor):
    """Trusted requests' own templates render on threads of their own, at most
    `REQUEST_TEMPLATE_THREADS` at once: with more slow ones than the server has tokenizer threads
    (here held inside their render until the test lets them go), a request with the server's
    template is prefilled and a /tokenize answered while they are held, and the one beyond the
    bound has not started. Before, they shared the four tokenizer threads: four slow ones held
    every request and /tokenize until one ended."""
    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS, TOKENIZER_THREADS

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    fast_conversation = _conversation("a red circle moves left")
    expected_fast = processor.tokenizer(
        processor.apply_chat_template(fast_conversation, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    entered, release = _Entered(), threading.Event()

    async def scenario():
        slow = [_slow_prefill(stage, f"slow{i}") for i in range(TOKENIZER_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            fast, counted = await _served_meanwhile(stage, fast_conversation)
            held = (entered.num_renders, sum(not s.done() for s in slow))
        finally:
            release.set()
        for handle in [fast, *await asyncio.wait_for(asyncio.gather(*slow), HANG_GUARD_S)]:
            await stage.release(handle, "done")
        await stage.close()
        return fast, counted, held

    with _slow_renders_held(adapter, entered, release, model_thread):
        fast, counted, held = asyncio.run(scenario())
    assert held == (REQUEST_TEMPLATE_THREADS, TOKENIZER_THREADS)  # the bound's renders held, the rest waiting
    assert fast.num_prompt_tokens == len(expected_fast) and counted.token_ids == expected_fast


def test_a_render_whose_deadline_passed_while_it_waited_is_refused_unrendered(adapter, caplog):
    """A prefill whose deadline (its gRPC call's) passes while it waits for a render thread (every
    one held here by a slow request template) is refused, DEADLINE_EXCEEDED, when a thread takes
    it, and its template never renders: before, it was rendered for nobody. The deadline is in the
    past when the threads are let go: nothing is timed. Its log line names the call's deadline,
    not the client's: in a prefill server it is often the gateway's bound on one attempt."""
    import logging
    import time

    import grpc

    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS
    from epd.stages.errors import DeadlineExceeded
    from epd.transport.errors import status_of

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()

    async def scenario():
        held = [_slow_prefill(stage, f"held{i}") for i in range(REQUEST_TEMPLATE_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            deadline_s = time.monotonic() + 0.05
            late = _slow_prefill(stage, "late", deadline_s)
            while time.monotonic() <= deadline_s:  # past its deadline before a thread is free
                await asyncio.sleep(0.05)
        finally:
            release.set()
        with pytest.raises(
            DeadlineExceeded, match="reached its deadline before its prompt was rendered"
        ) as info:
            await asyncio.wait_for(late, HANG_GUARD_S)
        for handle in await asyncio.wait_for(asyncio.gather(*held), HANG_GUARD_S):
            await stage.release(handle, "done")
        await stage.close()
        return info.value

    with (
        _slow_renders_held(adapter, entered, release, model_thread),
        caplog.at_level(logging.INFO, logger="epd.prefill_svc.stage"),
    ):
        refused = asyncio.run(scenario())
    assert entered.num_renders == REQUEST_TEMPLATE_THREADS  # the late one's template never rendered
    assert status_of(refused)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    said = [r.getMessage() for r in caplog.records if "request late was refused" in r.getMessage()]
    assert said == ["the render of request late was refused unrendered: its call's deadline passed while it "
                    "waited for a thread"]  # fmt: skip


class _CountingTokenizer:
    """The adapter's tokenizer, counting the calls that tokenise a text containing `marker`."""

    def __init__(self, tokenizer, marker: str) -> None:
        self.tokenizer, self.marker, self.num_calls = tokenizer, marker, 0

    def __call__(self, text, *args, **kwargs):
        self.num_calls += isinstance(text, str) and self.marker in text
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("call", ["prefill", "tokenize"])
def test_a_cancelled_render_stops_after_its_template(adapter, caplog, call):
    """A prefill or a /tokenize cancelled (its caller went away) while its chat template renders
    (held here) stops at the render's next step: its template's text is never tokenised nor given
    positions, and the stop is logged. The template's render itself runs to its end (Python cannot
    stop a thread). Before, the render ran to its end for nobody."""
    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()
    counting = _CountingTokenizer(adapter.tokenizer, "what colour is the circle?")

    async def scenario():
        slow = (_slow_prefill if call == "prefill" else _slow_tokenize)(stage, "gone")
        try:
            assert await asyncio.to_thread(entered.wait_for, 1)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
        finally:
            release.set()
        await asyncio.to_thread(stage.close_tokenizer)  # the render's thread has ended
        await stage.close()

    adapter.tokenizer = counting
    try:
        with _slow_renders_held(adapter, entered, release, model_thread):
            with caplog.at_level(logging.INFO, logger="epd.prefill_svc.stage"):
                asyncio.run(scenario())
    finally:
        adapter.tokenizer = counting.tokenizer
    assert counting.num_calls == 0
    assert any("render of request gone stopped between its steps" in r.getMessage() for r in caplog.records)


class _Gone(Exception):
    """What a render's checkpoint raises for a request that went away (the stage's own is private)."""


@pytest.mark.parametrize("media,num_frames", [("mp4", 8), ("png", 1)])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_render_stops_after_its_media_expansion(
    checkpoints, media_files, family, media, num_frames
):
    """Every family's `build_prompt` of a media prompt calls the render's checkpoint twice: after
    the chat template (`_render`, shared) and again after its own expansion and tokenisation of the
    media placeholder, before the positions (get_rope_index on a long video's prompt); a checkpoint
    that raises the second time leaves `build_prompt` with its exception. A family that forgets its
    own call renders a gone request's positions to their end."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "all")
    video = load_video(media_files, media, num_frames)
    meta = visual_meta(adapter, adapter.preprocess(video))
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise _Gone

    with pytest.raises(_Gone):
        adapter.build_prompt(
            question_message(video, "what moves?"), meta, RenderOptions(checkpoint=checkpoint)
        )
    assert calls == 2
    calls = -10  # never raises: a whole render calls it exactly twice
    adapter.build_prompt(question_message(video, "what moves?"), meta, RenderOptions(checkpoint=checkpoint))
    assert calls == -8


def _slow_tokenize(stage: LocalPrefillStage, request_id: str, deadline_s: float | None = None):
    request = TokenizeInput(
        messages=from_chat_template(_conversation("what colour is the circle?")),
        add_special_tokens=False,
        template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
    )
    return _with_client_deadline(lambda: stage.tokenize(request, request_id), deadline_s)


def test_a_tokenize_whose_deadline_passed_while_it_waited_is_refused_unrendered(adapter):
    """/tokenize gets its gRPC call's deadline and a prompt's checks (`LocalPrefillStage._render`):
    one whose deadline passes while every render thread is held is refused, DEADLINE_EXCEEDED,
    and its template never renders. Before, it had no deadline and was rendered for nobody. The
    deadline is in the past when the threads are let go: nothing is timed."""
    import time

    import grpc

    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS
    from epd.stages.errors import DeadlineExceeded
    from epd.transport.errors import status_of

    model_thread = ModelThread()
    stage = _trusting_stage(adapter, model_thread)
    entered, release = _Entered(), threading.Event()

    async def scenario():
        held = [_slow_tokenize(stage, f"held{i}") for i in range(REQUEST_TEMPLATE_THREADS)]
        try:
            assert await asyncio.to_thread(entered.wait_for, REQUEST_TEMPLATE_THREADS)
            deadline_s = time.monotonic() + 0.05
            late = _slow_tokenize(stage, "late", deadline_s)
            while time.monotonic() <= deadline_s:  # past its deadline before a thread is free
                await asyncio.sleep(0.05)
        finally:
            release.set()
        with pytest.raises(
            DeadlineExceeded, match="reached its deadline before its prompt was rendered"
        ) as info:
            await asyncio.wait_for(late, HANG_GUARD_S)
        answers = await asyncio.wait_for(asyncio.gather(*held), HANG_GUARD_S)
        await stage.close()
        return info.value, answers

    with _slow_renders_held(adapter, entered, release, model_thread):
        refused, answers = asyncio.run(scenario())
    assert entered.num_renders == REQUEST_TEMPLATE_THREADS  # the late one's template never rendered
    assert status_of(refused)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(a.token_ids for a in answers)
