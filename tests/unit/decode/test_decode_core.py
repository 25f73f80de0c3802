"""The decode core with the real tiny Qwen2-VL, in one process (`LocalDecodeStage` taking caches
from a `KvStore`): every batched step runs on the model thread, requests join and leave a running
batch, each one's tokens equal its tokens decoded alone, the first step carries the transfer
figures, and however a request ends (to the end, closed early, its reader cancelled, a step
failing) its row, its KV memory and its transferred cache are freed and no step runs for it again.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from contextlib import aclosing
from dataclasses import replace

import pytest
import torch

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.stage import LocalDecodeStage, take_from_store
from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig, SamplingFailed
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import PrefillHandle, TokenStep
from epd.stages.errors import InvalidRequest, ResourceExhausted
from epd.stages.messages import question_messages, to_chat_template
from epd.stages.model_thread import ModelThread
from tests.log_records import log_records

HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "decode")


@pytest.fixture
def thread():
    model_thread = ModelThread()
    yield model_thread
    model_thread.close()


class Calls:
    """Counts the batched decode steps, their batch sizes and the threads they ran on."""

    def __init__(self, adapter, monkeypatch, fail_at: int | None = None) -> None:
        self.threads: list[int] = []
        self.batch_sizes: list[int] = []
        step = adapter.decode_batch

        def decode_batch(token_ids, positions, batch):
            self.threads.append(threading.get_ident())
            self.batch_sizes.append(len(token_ids))
            if fail_at is not None and len(self.threads) == fail_at:
                raise RuntimeError("step failed")
            return step(token_ids, positions, batch)

        monkeypatch.setattr(adapter, "decode_batch", decode_batch)


def _prefilled(adapter, store: KvStore, question: str, grid=(1, 4, 4), seed: int = 0):
    """A real prefill of a one-image prompt, its cache put in `store`; returns the handle and a
    weak reference to the cache (the store holds the only strong one)."""
    n = adapter.num_visual_tokens(grid)
    messages = to_chat_template(question_messages(question), "image")
    prompt = adapter.build_prompt(messages, VisualMeta("image", grid, 0.0, n))
    embeds = torch.randn(n, adapter.hidden_size, generator=torch.Generator().manual_seed(seed))
    state = adapter.prefill(prompt, embeds)
    cache = state.cache
    handle = PrefillHandle(
        kv_handle=store.put(cache),
        first_token_id=int(state.last_logits.argmax()),
        num_prompt_tokens=state.num_prompt_tokens,
        num_cached_tokens=cache.num_cached_tokens,
        next_position_ids=[int(x) for x in state.next_position_ids],
        kv_num_bytes=cache.num_bytes,
        prefill_ms=0.0,
    )
    return handle, weakref.ref(cache)


def _alone(adapter, store, question, max_new, grid=(1, 4, 4), seed=0, generation=None) -> list[int]:
    """The request's greedy tokens decoded alone, step by step (no batch)."""
    handle, _ = _prefilled(adapter, store, question, grid, seed)
    gen = DecodeEngine(adapter).start(
        store.take(handle.kv_handle),
        handle.first_token_id,
        handle.next_position_ids,
        generation or GenerationConfig(max_new_tokens=max_new, ignore_eos=True),
    )
    tokens = [gen.first().token_ids[0]]
    while not gen.done:
        tokens += gen.step().token_ids
    return tokens


async def _tokens(
    stage,
    handle,
    max_new,
    started: asyncio.Event | None = None,
    after: asyncio.Event | None = None,
    generation: GenerationConfig | None = None,
) -> list[int]:
    """One request's greedy tokens (ignore_eos; or `generation`'s) through `stage`, once `after` is
    set; `started` is set at its second token (it is in the running batch then)."""
    if after is not None:
        await after.wait()
    out: list[int] = []
    generation = generation or GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    async for step in stage.generate(handle, generation, "r"):
        out += step.token_ids
        if started is not None and len(out) == 2:
            started.set()
    return out


def _stage(adapter, store, thread, **config) -> LocalDecodeStage:
    return LocalDecodeStage(DecodeEngine(adapter), take_from_store(store), thread, DecodeConfig(**config))


def _assert_idle(stage: LocalDecodeStage, *cache_refs) -> None:
    runner = stage.core.runner
    assert runner.rows == [] and stage.memory.num_holding == 0 and stage.memory.num_waiting == 0
    assert runner.batch is None or runner.batch.num_bytes == 0, "an idle decoder holds no KV memory"
    gc.collect()
    assert all(ref() is None for ref in cache_refs), "the transferred caches are no longer referenced"


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


def test_to_the_end_every_step_on_the_model_thread_and_everything_freed(adapter, thread, monkeypatch):
    calls = Calls(adapter, monkeypatch)
    store = KvStore(1 << 30, 60.0)
    handle, cache_ref = _prefilled(adapter, store, "what colour is the square?")
    stage = _stage(adapter, store, thread)

    async def scenario():
        steps = [
            s async for s in stage.generate(handle, GenerationConfig(max_new_tokens=5, ignore_eos=True), "r")
        ]
        return steps, await thread.run(threading.get_ident)

    steps, model_ident = _run(scenario())
    assert all(isinstance(s, TokenStep) and len(s.token_ids) == 1 for s in steps)
    assert [s.finish_reason for s in steps] == ["", "", "", "", "length"]
    assert steps[0].kv_num_bytes == handle.kv_num_bytes and steps[0].kv_transfer_ms >= 0
    assert [(s.kv_transfer_ms, s.kv_num_bytes) for s in steps[1:]] == [(0.0, 0)] * 4
    assert calls.threads == [model_ident] * 4, (
        "the first token is prefill's; 4 steps, all on the model thread"
    )
    assert stage.load().num_steps == 4 and stage.load().last_batch_size == 1
    _assert_idle(stage, cache_ref)


def test_requests_join_and_leave_a_running_batch_with_their_own_tokens(adapter, thread, monkeypatch):
    """Three prompts of different lengths: B starts while A runs, C after A has left; each
    one's greedy tokens equal its tokens decoded alone, and the batch really was shared."""
    store = KvStore(1 << 30, 60.0)
    specs = {  # name: (question, grid, max_new_tokens)
        "a": ("what colour is the square?", (1, 4, 4), 6),
        "b": ("how many squares move from the left to the right of the frame?", (1, 8, 8), 14),
        "c": ("which one?", (1, 4, 6), 8),
    }
    want = {k: _alone(adapter, store, q, n, g, seed=i) for i, (k, (q, g, n)) in enumerate(specs.items())}
    calls = Calls(adapter, monkeypatch)
    stage = _stage(adapter, store, thread)
    handles, refs = {}, []
    for i, (k, (q, g, _)) in enumerate(specs.items()):
        handles[k], ref = _prefilled(adapter, store, q, g, seed=i)
        refs.append(ref)

    async def consume(k, started: asyncio.Event | None = None, after: asyncio.Event | None = None):
        if after is not None:
            await after.wait()
        out = []
        gen = GenerationConfig(max_new_tokens=specs[k][2], ignore_eos=True)
        async for step in stage.generate(handles[k], gen, k):
            out += step.token_ids
            if started is not None and len(out) == 3:
                started.set()
        return out

    async def scenario():
        a_running, a_done = asyncio.Event(), asyncio.Event()

        async def a():
            out = await consume("a", started=a_running)
            a_done.set()
            return out

        return await asyncio.gather(a(), consume("b", after=a_running), consume("c", after=a_done))

    got = dict(zip("abc", _run(scenario())))
    assert got == want
    assert max(calls.batch_sizes) >= 2, f"the requests shared steps: batch sizes {calls.batch_sizes}"
    _assert_idle(stage, *refs)


def test_allowed_token_ids_and_bad_words_mask_their_own_row_of_a_shared_step(adapter, thread, monkeypatch):
    """Two requests in one batched step, one with allowed_token_ids and bad_words: its tokens keep
    to its masks, the other's row is untouched, and each equals its tokens decoded alone."""
    store = KvStore(1 << 30, 60.0)
    question, n = "what colour is the square?", 10
    plain = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    # tokens that are words of their own: each one's text tokenises back to it alone
    allowed = tuple(
        t for t in range(60, 300) if adapter.tokenize(adapter.tokenizer.decode([t]).lstrip(), False) == [t]
    )
    only_allowed = replace(plain, allowed_token_ids=allowed)
    first_pick = _alone(adapter, store, question, n, seed=1, generation=only_allowed)[1]
    word = adapter.tokenizer.decode([first_pick])
    assert adapter.bad_words_token_ids([word])[0] == (first_pick,), "a word of one token, banned outright"
    masked = replace(only_allowed, bad_words=(word,))
    want = {
        "plain": _alone(adapter, store, question, n, seed=0),
        "masked": _alone(adapter, store, question, n, seed=1, generation=masked),
    }
    assert set(want["plain"][1:]) - set(allowed), "the plain answer must leave the allowed tokens"
    assert set(want["masked"][1:]) <= set(allowed) and first_pick not in want["masked"][1:]
    calls = Calls(adapter, monkeypatch)
    stage = _stage(adapter, store, thread)
    handles = {k: _prefilled(adapter, store, question, seed=i)[0] for i, k in enumerate(want)}

    async def scenario():
        running = asyncio.Event()
        return await asyncio.gather(
            _tokens(stage, handles["plain"], n, started=running, generation=plain),
            _tokens(stage, handles["masked"], n, after=running, generation=masked),
        )

    got = dict(zip(want, _run(scenario())))
    assert got == want
    assert max(calls.batch_sizes) == 2, f"the requests shared steps: batch sizes {calls.batch_sizes}"
    _assert_idle(stage)


def test_closing_early_frees_the_row_and_stops_stepping(adapter, thread, monkeypatch):
    calls = Calls(adapter, monkeypatch)
    store = KvStore(1 << 30, 60.0)
    handle, cache_ref = _prefilled(adapter, store, "what colour is the square?")
    stage = _stage(adapter, store, thread)
    release = threading.Event()

    async def scenario():
        tokens = stage.generate(handle, GenerationConfig(max_new_tokens=50, ignore_eos=True), "r")
        async with aclosing(tokens):
            async for _ in tokens:
                # Hold the model thread, so no step can run while the reader leaves.
                blocked = asyncio.ensure_future(thread.run(release.wait, HANG_GUARD_S))
                break
        assert stage.memory.num_holding == 0, "the reservation goes the moment the reader leaves"
        steps_when_left = len(calls.threads)
        release.set()
        await blocked
        await asyncio.sleep(0.05)
        await thread.run(lambda: None)
        return steps_when_left

    steps_when_left = _run(scenario())
    # The core queues its next step as soon as it has handed out the last one's tokens: that step
    # may still run; none after it.
    assert len(calls.threads) <= steps_when_left + 1 <= 3, "no step ran after the one in flight"
    _assert_idle(stage, cache_ref)


def test_cancelling_the_reader_frees_everything(adapter, thread, monkeypatch):
    calls = Calls(adapter, monkeypatch)
    store = KvStore(1 << 30, 60.0)
    handle, cache_ref = _prefilled(adapter, store, "what colour is the square?")
    stage = _stage(adapter, store, thread)

    async def scenario():
        got_two = asyncio.Event()

        async def reader():
            n = 0
            async for _ in stage.generate(handle, GenerationConfig(max_new_tokens=400, ignore_eos=True), "r"):
                n += 1
                if n == 2:
                    got_two.set()

        task = asyncio.ensure_future(reader())
        await got_two.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        await thread.run(lambda: None)

    _run(scenario())
    assert 1 <= len(calls.threads) < 399, "it stopped early"
    _assert_idle(stage, cache_ref)


def test_a_failing_step_reaches_the_reader_and_frees_everything(adapter, thread, monkeypatch):
    Calls(adapter, monkeypatch, fail_at=2)
    store = KvStore(1 << 30, 60.0)
    handle, cache_ref = _prefilled(adapter, store, "what colour is the square?")
    stage = _stage(adapter, store, thread)
    release = stage.core.runner.release

    def slow_release(r):  # a release that takes a while must still be over when the reader hears
        time.sleep(0.2)
        release(r)

    monkeypatch.setattr(stage.core.runner, "release", slow_release)
    read: list[TokenStep] = []

    async def scenario():
        try:
            async for step in stage.generate(
                handle, GenerationConfig(max_new_tokens=20, ignore_eos=True), "r"
            ):
                read.append(step)
        except RuntimeError as exc:
            error = str(exc)  # only the message: the traceback holds the failed call's frames
            # As for a finished request: its row is freed before its reader sees the end.
            assert stage.core.runner.rows == [] and stage.core.runner.batch.num_rows == 0
        await asyncio.sleep(0.05)
        await thread.run(lambda: None)
        return error

    assert _run(scenario()) == "step failed"
    assert len(read) == 2, "prefill's token and the first step's"
    _assert_idle(stage, cache_ref)


def test_a_first_token_outside_the_vocabulary_is_refused_before_anything_is_reserved(adapter, thread):
    """The first batched step embeds the prefill's token: one outside the vocabulary would fail that
    step for every request of the batch, so it is refused first, and its cache is not taken."""
    store = KvStore(1 << 30, 60.0)
    handle, _ = _prefilled(adapter, store, "what colour is the square?")
    stage = _stage(adapter, store, thread)

    async def scenario():
        bad = replace(handle, first_token_id=adapter.vocab_size)
        with pytest.raises(InvalidRequest, match=f"first_token_id {adapter.vocab_size} is outside"):
            await anext(stage.generate(bad, GenerationConfig(max_new_tokens=4), "bad"))

    _run(scenario())
    assert len(store) == 1, "the cache was never taken"
    _assert_idle(stage)


def _poisoned(adapter, store: KvStore, question: str, seed: int) -> PrefillHandle:
    """A request whose cache holds NaN keys: its logits are NaN, which a temperature cannot sample."""
    handle, _ = _prefilled(adapter, store, question, seed=seed)
    cache = store.take(handle.kv_handle)
    nan = KvCache([torch.full_like(k, float("nan")) for k in cache.keys], [v.clone() for v in cache.values])
    return replace(handle, kv_handle=store.put(nan))


def test_a_request_whose_own_sampling_fails_fails_alone(adapter, thread, monkeypatch):
    """One request of a running batch cannot sample its token (NaN logits under a temperature): it
    ends with its error, and the other request's tokens go on, equal to its tokens alone."""
    store = KvStore(1 << 30, 60.0)
    max_new = 20
    want = _alone(adapter, store, "what colour is the square?", max_new)
    calls = Calls(adapter, monkeypatch)
    good, good_ref = _prefilled(adapter, store, "what colour is the square?")
    bad = _poisoned(adapter, store, "which one?", seed=1)
    stage = _stage(adapter, store, thread)

    async def scenario():
        good_running = asyncio.Event()

        async def run_bad():
            await good_running.wait()
            with pytest.raises(SamplingFailed, match="scores for this request's next token are not finite"):
                async for _ in stage.generate(
                    bad, GenerationConfig(max_new_tokens=max_new, temperature=1.0, seed=1), "bad"
                ):
                    pass

        out, _ = await asyncio.gather(_tokens(stage, good, max_new, good_running), run_bad())
        await asyncio.sleep(0.05)
        await thread.run(lambda: None)
        return out

    with log_records("epd.decode_svc.runner") as records:
        assert _run(scenario()) == want
    assert 2 in calls.batch_sizes, "the failing request shared a step with the other"
    _assert_idle(stage, good_ref)
    # Logged on the model thread, outside the request's context: its line still carries its id.
    (failure,) = [r for r in records if "failed at a step" in r.getMessage()]
    assert failure.request_id == "bad"  # type: ignore[attr-defined]


def test_a_request_moved_into_an_overflowed_requests_row_keeps_its_own_tokens(adapter, thread):
    """An overflowed request (inf in its values; greedy, so it runs on) leaves the batch; the last
    row moves into its place, beside a longer row whose length every step reads. Its tokens stay
    its own: the overflowed values left in the row's masked columns made them NaN (token 0)."""
    store = KvStore(1 << 30, 60.0)
    long_q, short_q = "how many squares move from the left to the right of the frame? " * 3, "which?"
    want = _alone(adapter, store, short_q, 30, seed=2)
    long, _ = _prefilled(adapter, store, long_q, (1, 8, 8), seed=0)
    overflowed, _ = _prefilled(adapter, store, "what shape is it there?", (1, 6, 8), seed=1)
    cache = store.take(overflowed.kv_handle)
    inf = KvCache([k.clone() for k in cache.keys], [torch.full_like(v, float("inf")) for v in cache.values])
    overflowed = replace(overflowed, kv_handle=store.put(inf))
    short, _ = _prefilled(adapter, store, short_q, seed=2)
    assert long.num_cached_tokens > overflowed.num_cached_tokens > short.num_cached_tokens
    stage = _stage(adapter, store, thread)

    async def scenario():
        started = [asyncio.Event() for _ in range(3)]
        return await asyncio.gather(
            _tokens(stage, long, 60, started[0]),
            _tokens(stage, overflowed, 5, started[1], after=started[0]),
            _tokens(stage, short, 30, started[2], after=started[1]),
        )

    _, _, got = _run(scenario())
    assert got == want


def test_requests_beyond_the_kv_budget_wait_for_room_and_all_finish(adapter, thread, monkeypatch):
    """A budget for two requests: the third waits (its cache is not taken from the store until
    there is room) and runs once one has left; a fourth finds the wait queue full."""
    calls = Calls(adapter, monkeypatch)
    store = KvStore(1 << 30, 60.0)
    handles = [_prefilled(adapter, store, "what colour is the square?", seed=i)[0] for i in range(4)]
    max_new = 6
    final = handles[0].num_cached_tokens + max_new
    budget = 2 * final * adapter.kv_bytes_per_token
    stage = _stage(adapter, store, thread, kv_budget_bytes=budget, max_waiting_requests=1)
    gen = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)

    async def run(h):
        return [t for s in [s async for s in stage.generate(h, gen, "r")] for t in s.token_ids]

    async def scenario():
        tasks = [asyncio.ensure_future(run(h)) for h in handles[:3]]
        while stage.memory.num_waiting == 0:
            await asyncio.sleep(0.001)
        assert len(store) >= 1, "the waiting request's cache is still in the store"
        with pytest.raises(ResourceExhausted, match="--kv-budget-bytes"):
            await run(handles[3])
        return await asyncio.gather(*tasks)

    outs = _run(scenario())
    assert [len(o) for o in outs] == [max_new] * 3
    assert max(calls.batch_sizes) == 2, "never more rows than the budget holds"
    assert len(store) == 1, "the refused request's cache was never taken"
    _assert_idle(stage)


def test_requests_whose_cache_is_on_its_way_count_as_waiting(adapter, thread):
    """They hold room and wait for their first step: routers and /metrics must see them."""
    store = KvStore(1 << 30, 60.0)
    handles = [_prefilled(adapter, store, "what colour is the square?", seed=i)[0] for i in range(3)]
    arrived = asyncio.Event()

    async def take_kv(handle):
        await arrived.wait()
        return store.take(handle.kv_handle)

    stage = LocalDecodeStage(DecodeEngine(adapter), take_kv, thread, DecodeConfig())

    async def scenario():
        readers = [
            asyncio.ensure_future(anext(stage.generate(h, GenerationConfig(max_new_tokens=3), "r")))
            for h in handles
        ]
        while stage.memory.num_holding < 3:
            await asyncio.sleep(0.001)
        during = stage.load()
        arrived.set()
        await asyncio.gather(*readers)
        return during

    during = _run(scenario())
    assert (during.num_running, during.num_waiting) == (0, 3)
    assert during.memory_used_bytes > 0
    assert stage.load().num_waiting == 0


def _leasing_stage(adapter, store, thread) -> LocalDecodeStage:
    """As the decode service does over the network: the pull leases the cache (prefill keeps a copy)
    and `confirm_kv` drops that copy."""

    async def take_kv(handle):
        return store.lease(handle.kv_handle)[0]

    async def confirm_kv(handle):
        store.confirm(handle.kv_handle)

    return LocalDecodeStage(DecodeEngine(adapter), take_kv, thread, DecodeConfig(), confirm_kv=confirm_kv)


def test_prefill_keeps_its_copy_until_the_first_token_is_out(adapter, thread):
    """A decoder lost between its pull and its first token must leave the cache for the gateway's
    retry on another decoder; once the first token is out nothing retries, and the copy goes."""
    store = KvStore(1 << 30, 60.0)
    handle, _ = _prefilled(adapter, store, "what colour is the square?")
    stage = _leasing_stage(adapter, store, thread)
    release = threading.Event()

    async def lost_before_the_first_token():
        started = threading.Event()

        def hold() -> None:
            started.set()
            release.wait(HANG_GUARD_S)

        # No token can come while the model thread runs `hold` (running, not queued: the admission
        # that sends the first token would go ahead of a queued call under ttft-first).
        blocked = asyncio.ensure_future(thread.run(hold))
        assert await asyncio.to_thread(started.wait, HANG_GUARD_S)
        reader = asyncio.ensure_future(anext(stage.generate(handle, GenerationConfig(max_new_tokens=4), "r")))
        while not store.is_leased(handle.kv_handle):
            await asyncio.sleep(0.01)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        release.set()
        await blocked

    _run(lost_before_the_first_token())
    assert store.is_leased(handle.kv_handle) and len(store) == 1, "still there for a retry"

    async def first_token_then_gone():
        tokens = stage.generate(handle, GenerationConfig(max_new_tokens=4, ignore_eos=True), "r")
        async with aclosing(tokens):
            first = await anext(tokens)
        await asyncio.sleep(0.05)  # the confirmation runs in the background
        return first

    first = _run(first_token_then_gone())
    assert first.token_ids == [handle.first_token_id]
    assert len(store) == 0 and store.num_confirmed == 1, "confirmed once the first token was out"


def test_a_batch_where_one_request_has_a_structured_output_constraint(adapter, thread, monkeypatch, request):
    """Two requests share every step, one under a constraint (letters and spaces, never ending):
    the constrained row's tokens are those it decodes alone under it, all letters and spaces; the
    other row's are its plain greedy tokens alone (a constraint in the batch changes nothing
    for it)."""
    from epd.model_runtime.sampling import StructuredOutputs
    from epd.model_runtime.structured_output import close_compiler, grammar_compiler

    # the stage compiles on the adapter's compiler's thread, as a decode service's does: closed as its server closes it
    request.addfinalizer(lambda: close_compiler(adapter, wait_s=HANG_GUARD_S))
    spec = StructuredOutputs(grammar="root ::= [a-z ] root")
    grammar = grammar_compiler(adapter).compile_now(spec)
    letter = adapter.tokenizer.encode("a")[0]  # prefill's token under the constraint
    store = KvStore(1 << 30, 60.0)
    constrained = GenerationConfig(max_new_tokens=10, ignore_eos=True, structured_outputs=spec)
    handle, _ = _prefilled(adapter, store, "what colour is the square?", seed=0)
    alone = DecodeEngine(adapter).start(
        store.take(handle.kv_handle), letter, handle.next_position_ids, constrained, grammar=grammar
    )
    want_constrained = [alone.first().token_ids[0]]
    while not alone.done:
        want_constrained += alone.step().token_ids
    want_plain = _alone(adapter, store, "which one?", 10, (1, 4, 6), seed=1)
    assert want_constrained != want_plain
    calls = Calls(adapter, monkeypatch)
    stage = _stage(adapter, store, thread)
    handle_c, _ = _prefilled(adapter, store, "what colour is the square?", seed=0)
    handle_c = replace(handle_c, first_token_id=letter)
    handle_p, _ = _prefilled(adapter, store, "which one?", (1, 4, 6), seed=1)

    async def tokens(handle, config):
        return [t async for s in stage.generate(handle, config, "r") for t in s.token_ids]

    async def scenario():
        plain = GenerationConfig(max_new_tokens=10, ignore_eos=True)
        return await asyncio.gather(tokens(handle_c, constrained), tokens(handle_p, plain))

    got_constrained, got_plain = _run(scenario())
    assert (got_constrained, got_plain) == (want_constrained, want_plain)
    assert all(c in "abcdefghijklmnopqrstuvwxyz " for c in adapter.tokenizer.decode(got_constrained))
    assert max(calls.batch_sizes) == 2, f"the requests shared steps: batch sizes {calls.batch_sizes}"
