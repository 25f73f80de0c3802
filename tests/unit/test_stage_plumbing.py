"""The async plumbing of the stages, in one process with the real tiny model (no servers):

- the encoder's per-request driver runs off the model thread, so a request whose frames are
  not coming (blocked deterministically with a threading.Event inside its frame stream) does
  not stop another request's encode from finishing, and both get the tokens they get alone;
- cancelling an encode sets its flag: no tower call follows and the frame stream is closed;
- the request pool bounds running + waiting drivers and says which flags raise the bounds;
- `with_events` cancels its call however the consumer leaves;
- the embedded pipeline leaves its KV store empty however a request ends;
- the first token leaves with prefill's answer (the decoder held meanwhile), never twice, and the
  stream is the one whose first token comes from the decoder.

Waits below carry a generous timeout only so that a broken build fails instead of hanging;
nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import threading
import time
from collections.abc import Generator
from contextlib import aclosing

import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.stage import LocalEncodeStage
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, MediaInput, PrefillStage, StageEvent, TokenStep
from epd.stages.errors import InvalidRequest, KvSourceLost, ResourceExhausted
from epd.stages.events import Finished, with_events
from epd.stages.messages import Message, question_messages
from epd.stages.model_thread import ModelThread
from epd.stages.request_pool import RequestPool
from epd.video.types import DecodedVideo, SamplingOptions

HANG_GUARD_S = 120.0
SAMPLING = SamplingOptions(num_frames=6)  # 3 frame groups of 2


class Gate:
    """Stands in the frame stream of one request: hands out the first group, then blocks
    (as a slow demux or decode would) until the test opens it."""

    def __init__(self) -> None:
        self.blocked = threading.Event()  # the first group is out, the second is being waited for
        self.open = threading.Event()
        self.closed = threading.Event()  # the driver closed the stream
        self.num_groups_out = 0

    def wrap(self, groups: Generator[DecodedVideo, None, None]) -> Generator[DecodedVideo, None, None]:
        try:
            for video in groups:
                if self.num_groups_out == 1:
                    self.blocked.set()
                    if not self.open.wait(HANG_GUARD_S):
                        raise RuntimeError("the gate was never opened")
                self.num_groups_out += 1
                yield video
        finally:
            groups.close()  # the real stream: cancels its pending decode work
            self.closed.set()


class GatedEngine(EncoderEngine):
    """The real engine; the frames of media listed in `gates` pass through a Gate."""

    gates: dict[str, Gate]

    def open_frames(self, data, sha256, sampling, cancel=None, merge=False, cache_salt=""):
        meta, groups = super().open_frames(data, sha256, sampling, cancel, merge, cache_salt)
        gate = self.gates.get(sha256)
        return meta, (gate.wrap(groups) if gate else groups)


def _engine(adapter, cls=EncoderEngine, **config) -> EncoderEngine:
    config = {"merge_decoded_groups": False, **config}  # groups as decoded pairs: the Gate counts them
    engine = cls(EncoderConfig(cache=TokenCacheConfig(memory_budget_bytes=0), **config), adapter)
    engine.gates = {}
    return engine


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")


@pytest.fixture(scope="module")
def videos(media_files) -> dict[str, bytes]:
    return {name: media_files[name].read_bytes() for name in ("mp4", "mp4_b")}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _wait(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, HANG_GUARD_S), "the test would hang here"


def test_model_thread_call_runs_there_and_refuses_to_wait_on_itself():
    thread = ModelThread()
    try:
        name = thread.call(lambda: threading.current_thread().name)
        assert name.startswith("model")
        with pytest.raises(RuntimeError, match="would wait forever"):
            thread.call(thread.call, lambda: None)
    finally:
        thread.close()


def test_a_blocked_decode_does_not_stop_another_requests_encode(adapter, videos, closing):
    """A waits for its second frame group (blocked) while B is encoded from start to end; B and A
    then give the same tokens as each encoded alone."""
    engine = _engine(adapter, GatedEngine)
    gate = engine.gates[_sha(videos["mp4"])] = Gate()
    stage = LocalEncodeStage(engine, ModelThread())

    async def scenario():
        task_a = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4"]), SAMPLING, lambda e: None, "a"))
        await _wait(gate.blocked)
        events_b: list[StageEvent] = []
        out_b = await asyncio.wait_for(
            stage.encode(MediaInput(videos["mp4_b"]), SAMPLING, events_b.append, "b"), HANG_GUARD_S
        )
        assert not task_a.done(), "A cannot have finished: its frames are held back"
        gate.open.set()
        return await task_a, out_b, events_b

    out_a, out_b, events_b = asyncio.run(scenario())
    assert gate.num_groups_out == 3 and gate.closed.is_set()
    assert [e.details["frames_done"] for e in events_b if e.state == "progress" and e.stage == "encode"] == [
        "2",
        "4",
        "6",
    ]
    alone = closing(_engine(adapter))
    for data, out in ((videos["mp4"], out_a), (videos["mp4_b"], out_b)):
        ref = alone.encode(MediaInput(data), SAMPLING, lambda e: None)
        assert out.meta == ref.meta
        torch.testing.assert_close(out.embeds, ref.embeds, rtol=0, atol=0)
    stage.close()  # its request drivers and decode workers; the model thread is the test's
    stage.model_thread.close()


def test_cancel_sets_the_flag_stops_tower_calls_and_closes_the_stream(adapter, videos, monkeypatch):
    # One group queued at a time, so the tower calls are countable: A 1, B one per group.
    engine = _engine(
        adapter, GatedEngine, max_concurrent_decodes=1, max_queued_decodes=1, max_tower_jobs_per_request=1
    )
    gate = engine.gates[_sha(videos["mp4"])] = Gate()
    tower_calls: list[str] = []
    encode = adapter.encode
    monkeypatch.setattr(adapter, "encode", lambda inputs: tower_calls.append("x") or encode(inputs))
    stage = LocalEncodeStage(engine, ModelThread())

    async def scenario():
        task_a = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4"]), SAMPLING, lambda e: None, "a"))
        await _wait(gate.blocked)
        assert len(tower_calls) == 1
        task_a.cancel()  # what gRPC does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task_a
        # B waits for the only driver slot, which A frees only once its driver has stopped.
        b = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4_b"]), SAMPLING, lambda e: None, "b"))
        gate.open.set()  # A's next group arrives: the driver sees the flag there
        await _wait(gate.closed)
        return await asyncio.wait_for(b, HANG_GUARD_S)

    out_b = asyncio.run(scenario())
    assert gate.num_groups_out == 2, "the driver took one more group, then stopped"
    assert len(tower_calls) == 1 + 3, "no tower call for A after the cancel (B made 3)"
    assert stage.drivers.num_cancelled == 1 and stage.drivers.num_admitted == 0
    assert out_b.num_frames == 6
    stage.close()
    stage.model_thread.close()


def test_request_pool_bounds_running_and_waiting_and_names_the_flags():
    pool = RequestPool(1, 1, lambda running, waiting: f"{running} running, {waiting} waiting: raise --max-x")
    release = threading.Event()
    ran: list[str] = []

    def driver(name: str):
        def drive(cancel: threading.Event) -> str:
            ran.append(name)
            assert release.wait(HANG_GUARD_S)
            return name

        return drive

    async def scenario():
        first = asyncio.ensure_future(pool.run(driver("first")))
        waiting = asyncio.ensure_future(pool.run(driver("waiting")))
        await asyncio.sleep(0)  # both admitted
        with pytest.raises(ResourceExhausted, match="1 running, 1 waiting: raise --max-x"):
            await pool.run(driver("refused"))
        waiting.cancel()  # its client went away while it waited: it never runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        assert await first == "first"
        assert await pool.run(driver("after")) == "after"

    asyncio.run(scenario())
    assert ran == ["first", "after"]
    assert pool.num_admitted == 0 and pool.num_cancelled == 1
    pool.close()


async def _reporting_call(cancelled: asyncio.Event, emit) -> str:
    emit("first")
    try:
        await asyncio.Event().wait()  # works until it is cancelled
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return "never"


@pytest.mark.parametrize("how", ["stream_closed", "consumer_cancelled", "consumer_task_ended"])
def test_with_events_cancels_its_call_however_the_consumer_leaves(how):
    async def scenario():
        cancelled, got_first = asyncio.Event(), asyncio.Event()
        stream = with_events(lambda emit: _reporting_call(cancelled, emit))
        kept: list[object] = [stream]  # an unclosed stream stays referenced: no GC rescue

        async def consume():
            async for item in stream:
                assert item == "first"
                got_first.set()
                if how == "consumer_task_ended":
                    return  # leaves without closing the stream
                if how == "stream_closed":
                    break
                # consumer_cancelled: read on; the next read waits inside the stream
            await stream.aclose()

        consumer = asyncio.ensure_future(consume())
        await got_first.wait()  # the consumer runs on until its next wait before we resume
        if how == "consumer_cancelled":
            consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.wait_for(cancelled.wait(), HANG_GUARD_S)
        return kept

    asyncio.run(scenario())


def test_with_events_yields_the_result_and_raises_the_calls_error():
    async def ok(emit):
        emit(1)
        emit(2)
        return "done"

    async def failing(emit):
        emit(1)
        raise InvalidRequest("bad")

    async def collect(call):
        return [item async for item in with_events(call)]

    items = asyncio.run(collect(ok))
    assert items[:2] == [1, 2] and isinstance(items[2], Finished) and items[2].value == "done"
    with pytest.raises(InvalidRequest, match="bad"):
        asyncio.run(collect(failing))


def test_kv_store_release_is_idempotent():
    from epd.model_runtime.kv_cache import KvCache

    k = torch.zeros(1, 2, 3, 4)
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(KvCache([k, k.clone()], [k.clone(), k.clone()]))
    assert store.release(handle) is True
    assert (len(store), store.num_bytes, store.num_released) == (0, 0, 1)
    assert store.release(handle) is False and store.release("unknown") is False


@pytest.fixture(scope="module")
def embedded(tiny_models):
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])))
    yield pipeline
    pipeline.close()


def _ask(videos, **generation) -> AskRequest:
    return AskRequest(
        messages=question_messages("what colour is the square?"),
        media=MediaInput(videos["mp4"]),
        sampling=SamplingOptions(num_frames=4),
        generation=GenerationConfig(**generation),
    )


def test_closing_an_embedded_pipeline_stops_every_thread_it_started(tiny_models, videos):
    before = set(threading.enumerate())
    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:

        async def ask():
            return [item async for item in pipeline.ask(_ask(videos, max_new_tokens=2))]

        assert isinstance(asyncio.run(ask())[-1], AskSummary)
        started = [t for t in threading.enumerate() if t not in before]
    kinds = {re.sub(r"[-_]\d+$", "", t.name) for t in started}  # model_0, video-decode-1, encode-driver_0
    assert {"model", "video-decode", "encode-driver"} <= kinds, kinds
    for thread in started:
        thread.join(10)
    assert [t.name for t in started if t.is_alive()] == []
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pipeline.prefill.model_thread.run(lambda: None))


def test_stopping_the_encoder_service_closes_its_decode_pool(tiny_models):
    """The encoder service's `HealthyServer.stop` (what `run_service` awaits after the drain)
    closes its stage: no decode worker or request driver it started is left running. Before, the
    pool stayed open until the process ended (`epd serve` leaves by os._exit, without atexit)."""
    from epd.encoder_svc import server
    from epd.stages.server_config import ServerConfig

    config = EncoderConfig(model=ModelConfig(model=str(tiny_models["qwen2_vl"])), server=ServerConfig(port=0))
    before = set(threading.enumerate())

    async def scenario() -> list[threading.Thread]:
        hs = await server.start(config)
        started = [t for t in threading.enumerate() if t not in before and t.name.startswith("video-decode")]
        await hs.stop(0)
        return started

    started = asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert started, "the service started no decode worker"
    assert [t.name for t in started if t.is_alive()] == []


PART_S = 0.05
"""How long each closed part takes here, at least (a sleep): enough to tell one deadline from two."""
CLOSE_TIMEOUT_S = 3.0
"""The closes' one deadline here (`--close-timeout-s`), far below the default (30 s)."""


@pytest.mark.parametrize("service", ["encoder", "prefill", "decode"])
def test_a_model_servers_parts_close_in_turn_against_one_deadline(tiny_models, monkeypatch, service):
    """After its drain, a model server closes what holds threads in turn, each part given what
    is left of one bound, its config's (`close_in_turn`, at most `close_timeout_s` in all:
    --close-timeout-s): each part's wait is at least PART_S (the time the part before it took)
    below the one before, the first within the config's bound. A part closed with a bound of its
    own (`hs.closers += [part.close]`: its default, or a fresh CLOSE_WAIT_S) gets a wait that does
    not shrink, or none at all, and fails this; so does a close that ignores the config (30 s,
    hard-coded, before). The waits given are recorded, not timed."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.stage import LocalPrefillStage
    from epd.stages.server_config import ServerConfig

    server_config = ServerConfig(port=0, close_timeout_s=CLOSE_TIMEOUT_S)

    given: list[tuple[str, float | None]] = []

    def spy(owner: type, method: str, name: str) -> None:
        original = getattr(owner, method)

        def close(self, wait_s=None):
            given.append((name, wait_s))
            time.sleep(PART_S)
            return original(self) if wait_s is None else original(self, wait_s)

        monkeypatch.setattr(owner, method, close)

    spy(ModelThread, "close", "model thread")
    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    if service == "encoder":
        from epd.encoder_svc import server as encoder_server

        spy(LocalEncodeStage, "close", "decode pool and drivers")
        start = encoder_server.start(EncoderConfig(model=model, server=server_config))
        parts = ["decode pool and drivers", "model thread"]
    elif service == "prefill":
        from epd.prefill_svc import server as prefill_server

        spy(LocalPrefillStage, "close_tokenizer", "tokenizer threads")
        spy(LocalPrefillStage, "close_compiles", "grammar compiles")
        start = prefill_server.start(PrefillConfig(model=model, server=server_config))
        parts = ["tokenizer threads", "model thread", "grammar compiles"]
    else:
        from epd.decode_svc import server as decode_server
        from epd.decode_svc.config import DecodeConfig
        from epd.model_runtime.structured_output import close_compiler as original_close_compiler

        def close_compiler(adapter, wait_s=None):
            given.append(("grammar compiles", wait_s))
            time.sleep(PART_S)
            original_close_compiler(adapter, wait_s)

        monkeypatch.setattr(decode_server, "close_compiler", close_compiler, raising=False)
        start = decode_server.start(DecodeConfig(model=model, server=server_config))
        parts = ["model thread", "grammar compiles"]

    async def scenario() -> None:
        hs = await start
        await hs.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), HANG_GUARD_S))
    assert [name for name, _ in given] == parts
    waits = [wait_s for _, wait_s in given]
    assert all(w is not None for w in waits), f"a part closed with its own default bound: {given}"
    assert waits[0] <= CLOSE_TIMEOUT_S, f"the close ignored its config's bound: {given}"
    for before, after in zip(waits, waits[1:], strict=False):
        assert after <= before - PART_S, f"a part got a bound of its own: {given}"


def test_epd_ask_closes_its_pipeline_within_its_close_timeout(tiny_models, monkeypatch, capsys):
    """`epd ask` (embedded) closes its pipeline once its answer is printed, against one deadline,
    --close-timeout-s: the exit hooks then find no model thread pool or grammar compiler of it
    left, whose waits would each have a deadline of their own (`epd ask` with a pathological
    regex waited for the compile at interpreter exit, `structured_output.EXIT_WAIT_S`, whatever
    the close's deadline). The deadlines given are recorded, not timed."""
    from epd.cli.ask import run_ask
    from epd.cli.parsers.root import build_parser
    from epd.gateway.embedded import EmbeddedPipeline
    from epd.model_runtime import structured_output
    from epd.stages import model_thread

    given: list[float] = []
    original = EmbeddedPipeline.close

    def close(self, wait_s=None):
        given.append(self.close_timeout_s if wait_s is None else wait_s)
        original(self, wait_s)

    monkeypatch.setattr(EmbeddedPipeline, "close", close)
    pools, compilers = set(model_thread._open_pools), set(structured_output._COMPILERS.values())
    model = str(tiny_models["qwen2_vl"])
    flags = ["--max-new-tokens", "2", "--regex", "a+", "--close-timeout-s", str(CLOSE_TIMEOUT_S)]
    code = run_ask(build_parser().parse_args(["ask", "--no-video", "hi?", "--model", model, *flags]))
    assert code == 0, capsys.readouterr().err
    assert given == [CLOSE_TIMEOUT_S]
    assert set(model_thread._open_pools) <= pools, "a model thread pool of epd ask was left to the exit"
    assert set(structured_output._COMPILERS.values()) <= compilers, (
        "a compiler of epd ask was left to the exit"
    )


@pytest.mark.parametrize(
    "leave_at", [("prefill", "started"), ("prefill", "finished"), ("kv_transfer", "finished")]
)
def test_embedded_pipeline_leaves_no_kv_cache_however_the_request_ends(embedded, videos, leave_at):
    store: KvStore = embedded.prefill.kv_store

    async def scenario():
        async with aclosing(embedded.ask(_ask(videos, max_new_tokens=8))) as events:
            async for item in events:
                if isinstance(item, StageEvent) and (item.stage, item.state) == leave_at:
                    break  # the client goes away here
        # Closing the stream waited for the pipeline task to stop and clean up.
        assert (len(store), store.num_bytes) == (0, 0)
        items = [item async for item in embedded.ask(_ask(videos, max_new_tokens=4))]
        assert isinstance(items[-1], AskSummary) and len(items[-1].token_ids) == 4
        assert (len(store), store.num_bytes) == (0, 0)

    asyncio.run(scenario())


def test_a_cancel_that_lands_as_prefills_answer_arrives_leaves_no_kv_cache(embedded, videos):
    """The race the stack showed (5 of 51 clients that left 5-30 ms in): prefill's answer, with its
    stored cache's handle, is in, and the request's task is cancelled before it resumes; asyncio
    then throws the cancel in at that await and the handle is lost with the task, the cache kept
    until --kv-ttl. Reproduced exactly: the real stage answers through a future that completes
    in the same loop turn as the cancel of the pipeline's task."""
    from epd.gateway.pipeline import Pipeline

    store: KvStore = embedded.prefill.kv_store
    real = embedded.prefill

    class AnswerWithTheCancel(PrefillStage):
        async def prefill(self, *args, **kwargs):
            handle = await real.prefill(*args, **kwargs)
            assert len(store) == 1  # stored: the answer carries its handle
            loop = asyncio.get_running_loop()
            answer = loop.create_future()
            loop.call_soon(answer.set_result, handle)
            loop.call_soon(_pipeline_task().cancel)  # before that task resumes with the answer
            return await answer

        async def release(self, handle, request_id):
            await real.release(handle, request_id)

    def _pipeline_task() -> asyncio.Task:
        (task,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Pipeline.ask.<locals>.run"]
        return task

    pipeline = Pipeline(embedded.encoder, AnswerWithTheCancel(), embedded.decoder)

    async def scenario():
        with pytest.raises(asyncio.CancelledError):
            [item async for item in pipeline.ask(_ask(videos, max_new_tokens=4))]
        for _ in range(100):  # the release runs as a task of its own
            if not len(store):
                break
            await asyncio.sleep(0.01)
        return len(store), store.num_bytes

    assert asyncio.run(scenario()) == (0, 0)


@pytest.mark.parametrize("rpc_end", ["cancelled", "ok", "failed"])
def test_prefill_releases_a_stored_cache_whose_rpc_ended_cancelled(embedded, videos, rpc_end, monkeypatch):
    """The server's half of that race: the handler has no await left after storing the cache, so a
    caller that goes away then is seen only in how the RPC ends. Ended cancelled, the answer never
    got out: the cache is released; ended OK, the caller has the handle: it stays; the answer failed
    on its way after the cache was stored (an error, not a cancel): released too, not left to its TTL."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.servicer import PrefillServicer
    from epd.transport import convert
    from epd.v1 import prefill_pb2

    store: KvStore = embedded.prefill.kv_store
    servicer = PrefillServicer(PrefillConfig(), store)
    servicer.stage = embedded.prefill

    class RpcEnd:
        """The end-of-RPC part of grpc.aio.ServicerContext."""

        def __init__(self) -> None:
            self.callbacks: list = []

        def add_done_callback(self, callback) -> None:
            self.callbacks.append(callback)

        def cancelled(self) -> bool:
            return rpc_end == "cancelled"

        def time_remaining(self) -> float | None:
            return None  # the caller set no deadline

        async def abort(self, code, message, trailing_metadata=()):  # what rpc_errors ends a failed call with
            raise RuntimeError(message)

    async def scenario():
        request = _ask(videos, max_new_tokens=4)
        media = await embedded.encoder.encode(request.media, request.sampling, lambda event: None, "rpc-end")

        async def messages():
            yield prefill_pb2.PrefillRequest(
                header=prefill_pb2.PrefillHeader(
                    request_id="rpc-end",
                    messages=convert.messages_to_proto(request.messages),
                    visual=convert.encode_result_to_proto(media),
                    generation=convert.generation_to_proto(request.generation),
                )
            )
            for chunk in convert.encoded_media_chunks(media):
                yield prefill_pb2.PrefillRequest(visual_embeds=chunk)

        context = RpcEnd()
        if rpc_end == "failed":
            stored: list[str] = []

            def fails(handle):
                stored.append(handle.kv_handle)
                raise RuntimeError("the result could not be made")

            monkeypatch.setattr(convert, "handle_to_proto", fails)
            with pytest.raises(RuntimeError):
                [r async for r in servicer.Prefill(messages(), context)]
            (kv_handle,) = stored
        else:
            (response,) = [r async for r in servicer.Prefill(messages(), context)]  # no prompt logprobs asked
            kv_handle = response.result.kv_handle
        assert len(store) == 1
        for callback in context.callbacks:  # the RPC ends
            callback(context)
        return kv_handle

    kv_handle = asyncio.run(scenario())
    assert len(store) == (1 if rpc_end == "ok" else 0)
    store.release(kv_handle)


def test_a_prefill_call_cancelled_as_its_answer_goes_out_is_released_by_the_callers_handle(embedded, videos):
    """The third side of that race (the audit's stack left 1-2 caches of 36-48 clients cut 0.1-0.6 s
    in): the server sent its answer, so its RPC ended well and it keeps the cache, and the caller's
    call was cancelled before the answer arrived, so the caller never had the handle. The remote
    stage now picks the handle itself and releases it when its call is cancelled. Through a real
    gRPC server and channel; the server's own release is off (its RPC ended OK)."""
    import grpc

    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.servicer import PrefillServicer
    from epd.transport.remote_prefill import RemotePrefillStage
    from epd.transport.replica_pool import ReplicaPool
    from epd.v1 import prefill_pb2_grpc

    store: KvStore = embedded.prefill.kv_store
    real = embedded.prefill
    caller: list[asyncio.Task] = []
    stored_under: list[str] = []

    class CancelTheCallerOnceStored:
        async def prefill(self, *args, **kwargs):
            handle = await real.prefill(*args, **kwargs)
            stored_under.append(handle.kv_handle)
            caller[0].cancel()  # the caller leaves as the answer goes out
            return handle

    servicer = PrefillServicer(PrefillConfig(), store)
    servicer.stage = CancelTheCallerOnceStored()  # type: ignore[assignment]
    servicer._release_unless_answered = lambda kv_handle, request_id, answered: lambda context: None  # type: ignore[method-assign]

    async def scenario():
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ReplicaPool([f"127.0.0.1:{port}"])
        try:
            request = _ask(videos, max_new_tokens=4)
            media = await embedded.encoder.encode(request.media, request.sampling, lambda event: None, "race")
            stage = RemotePrefillStage(pool, timeout_s=60)
            caller.append(
                asyncio.ensure_future(stage.prefill(request.messages, media, request.generation, "race"))
            )
            with pytest.raises(asyncio.CancelledError):
                await caller[0]
            for _ in range(300):  # the release runs on its own
                if not len(store):
                    break
                await asyncio.sleep(0.01)
            return len(store), store.num_bytes
        finally:
            await pool.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == (0, 0)
    assert len(stored_under) == 1 and re.fullmatch(r"[0-9a-f]{32}", stored_under[0])


@pytest.mark.parametrize("malformed", ["past the entries' bound", "a prompt logprob short", "no positions"])
def test_a_malformed_prefill_answer_is_internal_and_its_kv_cache_released(
    embedded, videos, malformed, monkeypatch
):
    """Our own prefill's malformed answer (more prompt logprob entries than the gateway holds, a
    wrong count of them, a malformed result) is prefill's fault, INTERNAL (500), and the cache it
    stored is released as the request ends: its RPC ended well (or the gateway stopped reading
    it), so the server keeps it for a decoder that never comes, until --kv-ttl. The gateway's
    pipeline over a real remote prefill stage, a real prefill servicer on a real gRPC server, its
    real stage storing the cache, the answer made malformed on its way out."""
    import grpc

    from epd.gateway.pipeline import Pipeline
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.servicer import PrefillServicer
    from epd.transport import convert
    from epd.transport.errors import status_of
    from epd.transport.remote_prefill import RemotePrefillStage
    from epd.transport.replica_pool import ReplicaPool
    from epd.v1 import prefill_pb2_grpc

    store: KvStore = embedded.prefill.kv_store
    real = embedded.prefill
    stored_under: list[str] = []

    class AnswersMalformed:
        async def prefill(self, *args, **kwargs):
            handle = await real.prefill(*args, **kwargs)
            stored_under.append(handle.kv_handle)
            if malformed == "a prompt logprob short":
                return dataclasses.replace(handle, prompt_logprobs=handle.prompt_logprobs[1:])
            if malformed == "no positions":
                return dataclasses.replace(handle, next_position_ids=[])
            return handle

    if malformed == "past the entries' bound":  # the gateway's reading; prefill's own check is the engine's
        monkeypatch.setattr(convert, "MAX_PROMPT_LOGPROB_ENTRIES", 3)
    servicer = PrefillServicer(PrefillConfig(), store)
    servicer.stage = AnswersMalformed()  # type: ignore[assignment]

    async def scenario() -> BaseException:
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stage = RemotePrefillStage(ReplicaPool([f"127.0.0.1:{port}"]), timeout_s=60)
        try:
            pipeline = Pipeline(embedded.encoder, stage, embedded.decoder)
            with pytest.raises(RuntimeError, match="prefill") as failed:
                async for _ in pipeline.ask(_ask(videos, max_new_tokens=4, prompt_logprobs=1)):
                    pass
            return failed.value
        finally:
            await stage.close()
            await server.stop(None)

    error = asyncio.run(scenario())
    assert status_of(error)[0] == grpc.StatusCode.INTERNAL, error
    assert len(stored_under) == 1 and (len(store), store.num_bytes) == (0, 0)


def test_a_callers_kv_handle_must_be_a_new_random_id():
    from epd.model_runtime.kv_cache import KvCache
    from epd.prefill_svc.kv_store import check_handle

    assert check_handle("") == "" and check_handle("ab" * 16) == "ab" * 16
    for bad in ("x", "AB" * 16, "ab" * 17, "../" * 11):
        with pytest.raises(InvalidRequest, match="32 lowercase hex digits"):
            check_handle(bad)
    store = KvStore(max_bytes=10_000, ttl_s=10)
    k = torch.zeros(1, 2, 3, 4)
    assert store.put(KvCache([k], [k.clone()]), "ab" * 16) == "ab" * 16
    with pytest.raises(InvalidRequest, match="already names a stored KV cache"):
        store.put(KvCache([k], [k.clone()]), "ab" * 16)


def test_a_decoder_that_fails_before_pulling_leaves_no_kv_cache(embedded, videos):
    """A real remote decode stage refuses the in-process handle (it has no kv_address) before
    pulling: the pipeline must release the cache prefill stored."""
    from epd.gateway.pipeline import Pipeline
    from epd.transport.remote_decode import RemoteDecodeStage
    from epd.transport.replica_pool import ReplicaPool

    store: KvStore = embedded.prefill.kv_store

    released_before = store.num_released

    async def scenario():
        pipeline = Pipeline(
            embedded.encoder, embedded.prefill, RemoteDecodeStage(ReplicaPool(["127.0.0.1:1"]), 5.0)
        )
        stages_seen = []
        with pytest.raises(InvalidRequest, match="kv_address"):
            async for item in pipeline.ask(_ask(videos, max_new_tokens=4)):
                if isinstance(item, StageEvent):
                    stages_seen.append((item.stage, item.state))
        assert ("prefill", "finished") in stages_seen
        assert (len(store), store.num_bytes, store.num_released) == (0, 0, released_before + 1)
        await pipeline.decoder.close()

    asyncio.run(scenario())


def test_a_decoder_lost_after_its_first_token_leaves_no_kv_cache(embedded, videos):
    """A service decoder leases the cache (prefill keeps its copy for a retry elsewhere) and confirms
    receipt just after its first token; one lost in between (killed) left the copy at prefill until
    its TTL. The real decode stage, pulling as the service does (lease, and here never a confirm),
    whose stream then breaks as the gateway sees a lost replica's: the pipeline releases the copy."""
    from epd.decode_svc.stage import LocalDecodeStage
    from epd.gateway.pipeline import Pipeline
    from epd.transport.errors import UpstreamError, broken_stream

    store: KvStore = embedded.prefill.kv_store
    local = embedded.decoder

    async def lease_kv(handle):
        return store.lease(handle.kv_handle)[0]

    leasing = LocalDecodeStage(local.engine, lease_kv, local.model_thread, local.config)

    class LostAfterFirstToken(DecodeStage):
        async def generate(self, handle, generation, request_id, pruning=None):
            async with aclosing(leasing.generate(handle, generation, request_id)) as steps:
                async for step in steps:
                    yield step
                    raise broken_stream("decode", len(step.token_ids), request_id)

    released_before = store.num_released

    async def scenario():
        pipeline = Pipeline(embedded.encoder, embedded.prefill, LostAfterFirstToken())
        tokens = []
        with pytest.raises(UpstreamError, match="failed after 1 tokens"):
            async for item in pipeline.ask(_ask(videos, max_new_tokens=4)):
                if isinstance(item, TokenStep):
                    tokens += item.token_ids
        assert len(tokens) == 1, "the client had the first token before the decoder was lost"
        assert (len(store), store.num_bytes, store.num_released) == (0, 0, released_before + 1)

    asyncio.run(scenario())


def test_the_prefill_stage_returns_the_engines_handle_with_where_its_cache_waits(embedded, videos):
    """The engine builds the PrefillHandle; the stage stores the cache and adds only its place."""
    store: KvStore = embedded.prefill.kv_store

    async def scenario():
        media = await embedded.encoder.encode(
            MediaInput(videos["mp4"]), SamplingOptions(num_frames=4), lambda e: None, "r"
        )
        handle = await embedded.prefill.prefill(
            question_messages("what colour is the square?"), media, GenerationConfig(max_new_tokens=4), "r"
        )
        return handle, store.take(handle.kv_handle)

    handle, cache = asyncio.run(scenario())
    assert handle.kv_handle and handle.kv_address == "", "in-process: taken from the store, not pulled"
    assert (handle.num_cached_tokens, handle.kv_num_bytes) == (cache.num_cached_tokens, cache.num_bytes)
    assert handle.visual_entry_mask is None, "sent only when decode-stage eviction is on"
    assert (len(store), store.num_bytes) == (0, 0)


class HeldDecoder(DecodeStage):
    """The embedded decode stage, held until the test opens it: nothing reaches a decoder before."""

    def __init__(self, inner: DecodeStage) -> None:
        self.inner = inner
        self.open = asyncio.Event()

    async def generate(self, handle, generation, request_id, pruning=None):
        await asyncio.wait_for(self.open.wait(), HANG_GUARD_S)
        async with aclosing(self.inner.generate(handle, generation, request_id)) as steps:
            async for step in steps:
                yield step


class FirstTextDropped:
    """The embedded prefill stage, its handles without `first_text`: the first token then comes
    from the decoder, as it did before prefill worked its text out."""

    def __init__(self, inner) -> None:
        self.inner = inner

    async def prefill(self, *args, **kwargs):
        return dataclasses.replace(await self.inner.prefill(*args, **kwargs), first_text=None)

    async def release(self, handle, request_id):
        await self.inner.release(handle, request_id)


def _run(pipeline, request, on_token=None) -> list:
    async def scenario():
        items = []
        async for item in pipeline.ask(request):
            items.append(item)
            if isinstance(item, TokenStep) and on_token is not None:
                on_token(item)
        return items

    return asyncio.run(scenario())


def _kv_event_at(items) -> int:
    return next(i for i, x in enumerate(items) if isinstance(x, StageEvent) and x.stage == "kv_transfer")


def test_the_first_token_goes_out_before_a_decoder_has_the_cache(embedded, videos):
    """The first token leaves with prefill's answer (its text worked out by prefill), while the
    decoder is still held; the decoder's own first step (the same token) is not sent twice, and the
    stream equals, token for token and character for character, the one whose first token comes
    from the decoder."""
    from epd.gateway.pipeline import Pipeline

    request = _ask(videos, max_new_tokens=6)
    held = HeldDecoder(embedded.decoder)
    early = _run(Pipeline(embedded.encoder, embedded.prefill, held), request, lambda step: held.open.set())
    late = _run(Pipeline(embedded.encoder, FirstTextDropped(embedded.prefill), embedded.decoder), request)

    steps = [x for x in early if isinstance(x, TokenStep)]
    assert early.index(steps[0]) < _kv_event_at(early), "the first token came before the cache moved"
    assert len(steps[0].token_ids) == 1 and all(s.token_ids or s.text or s.finish_reason for s in steps)
    late_steps = [x for x in late if isinstance(x, TokenStep)]
    assert late.index(late_steps[0]) > _kv_event_at(late)
    assert [t for s in steps for t in s.token_ids] == [t for s in late_steps for t in s.token_ids]
    assert "".join(s.text for s in steps) == "".join(s.text for s in late_steps)
    summary, late_summary = early[-1], late[-1]
    assert isinstance(summary, AskSummary) and isinstance(late_summary, AskSummary)
    assert (summary.token_ids, summary.answer, summary.finish_reason) == (
        late_summary.token_ids,
        late_summary.answer,
        late_summary.finish_reason,
    )
    assert len(summary.token_ids) == 6 and summary.finish_reason == "length"
    assert summary.timings_ms["ttft"] <= summary.timings_ms["total"]


def test_a_first_token_that_ends_the_request_comes_from_the_decoder(embedded, videos):
    """Only the decoder sends a finish: a first token that ends the request (max_new_tokens=1, or
    a stop string in its text) is not sent early; the one step comes after the cache moved."""
    from epd.gateway.pipeline import Pipeline

    pipeline = Pipeline(embedded.encoder, embedded.prefill, embedded.decoder)
    first = _run(pipeline, _ask(videos, max_new_tokens=2))[-1]
    stop = first.answer[:1]
    assert stop, "the first token of this model's answer has text"
    for generation in ({"max_new_tokens": 1}, {"max_new_tokens": 4, "stop": (stop,)}):
        items = _run(pipeline, _ask(videos, **generation))
        steps = [x for x in items if isinstance(x, TokenStep)]
        assert items.index(steps[0]) > _kv_event_at(items), generation
        assert steps[-1].finish_reason == ("length" if "stop" not in generation else "stop")
        assert items[-1].token_ids == first.token_ids[:1]


def test_a_decoder_whose_first_step_differs_from_the_token_sent_stops_the_stream():
    """Prefill and decoder apply the same rules to the same token, so the decoder's first step
    starts with what was sent; if it ever did not, the stream stops rather than show the client two
    versions of its answer."""
    from epd.gateway.choice_progress import after_sent

    sent = TokenStep([7], " the")
    assert after_sent(TokenStep([7], " the"), sent) is None
    assert after_sent(TokenStep([7, 8], " the cat"), sent) == TokenStep([8], " cat")
    assert after_sent(TokenStep([7], " the", "length"), sent) == TokenStep([], "", "length")
    for other in (TokenStep([8], " the"), TokenStep([7], " a")):
        with pytest.raises(RuntimeError, match="does not start with the token sent from prefill"):
            after_sent(other, sent)


def test_no_decoder_after_the_first_token_went_out_passes_the_stages_status_on(embedded, videos):
    """Every decode replica unavailable, the client already holding the first token (sent with
    prefill's answer): the decode stage's UNAVAILABLE passes on as it is (a non-streaming client
    has seen nothing and gets 503; the SDK retries no stream that had tokens), and the cache
    prefill stored is released."""
    import grpc

    from epd.gateway.pipeline import Pipeline
    from epd.transport.errors import UpstreamError

    class Unavailable(DecodeStage):
        async def generate(self, handle, generation, request_id, pruning=None):
            raise UpstreamError(
                grpc.StatusCode.UNAVAILABLE, f"decode stage unavailable (request id {request_id})"
            )
            yield  # an async generator, as the stages are

    store: KvStore = embedded.prefill.kv_store
    released_before = store.num_released
    tokens: list[int] = []
    with pytest.raises(UpstreamError, match="decode stage unavailable") as err:
        _run(
            Pipeline(embedded.encoder, embedded.prefill, Unavailable()),
            _ask(videos, max_new_tokens=4),
            lambda step: tokens.extend(step.token_ids),
        )
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and len(tokens) == 1
    assert (len(store), store.num_bytes, store.num_released) == (0, 0, released_before + 1)


class LosesTheFirstCache(DecodeStage):
    """The embedded decode stage, except that its first request finds its KV source gone (as when
    the prefill replica holding the cache died), as a remote decoder answers then."""

    def __init__(self, inner: DecodeStage) -> None:
        self.inner = inner
        self.calls = 0

    async def generate(self, handle, generation, request_id, pruning=None):
        self.calls += 1
        if self.calls == 1:
            raise KvSourceLost("the prefill replica that held this request's KV cache went away")
        async with aclosing(self.inner.generate(handle, generation, request_id)) as steps:
            async for step in steps:
                yield step


class SecondPrefillSamplesAnother:
    """The embedded prefill stage, whose second answer has another first token (a sampled one)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = 0

    async def prefill(self, *args, **kwargs):
        self.calls += 1
        handle = await self.inner.prefill(*args, **kwargs)
        return (
            handle
            if self.calls == 1
            else dataclasses.replace(handle, first_token_id=handle.first_token_id + 1)
        )

    async def release(self, handle, request_id):
        await self.inner.release(handle, request_id)


@pytest.mark.parametrize("same_first_token", [True, False])
def test_a_second_prefill_after_a_lost_cache_goes_on_only_from_the_token_sent(
    embedded, videos, same_first_token
):
    """The client holds the first prefill's token when the cache is lost: the pipeline prefills
    again and goes on only if that gives the same token (greedy: it does; the answer is the one of
    a run without the loss, the token not sent twice); else the request fails with the loss, and
    neither cache is left at prefill."""
    from epd.gateway.pipeline import Pipeline

    store: KvStore = embedded.prefill.kv_store
    prefill = embedded.prefill if same_first_token else SecondPrefillSamplesAnother(embedded.prefill)
    pipeline = Pipeline(embedded.encoder, prefill, LosesTheFirstCache(embedded.decoder))
    request = _ask(videos, max_new_tokens=5)
    if same_first_token:
        items = _run(pipeline, request)
        clean = _run(Pipeline(embedded.encoder, embedded.prefill, embedded.decoder), request)
        assert (items[-1].token_ids, items[-1].answer) == (clean[-1].token_ids, clean[-1].answer)
        assert sum(len(x.token_ids) for x in items if isinstance(x, TokenStep)) == 5
    else:
        tokens: list[int] = []
        with pytest.raises(KvSourceLost, match="went away"):
            _run(pipeline, request, lambda step: tokens.extend(step.token_ids))
        assert len(tokens) == 1
    assert (len(store), store.num_bytes) == (0, 0)


def test_max_tokens_over_the_stages_bound_is_refused_before_the_media_is_encoded(embedded, videos):
    """It was refused by prefill, after the encoder had decoded and encoded the video (whose
    stage events came first)."""

    async def scenario():
        events = []
        with pytest.raises(InvalidRequest, match="max_new_tokens must be between 1 and 4096"):
            async for item in embedded.ask(_ask(videos, max_new_tokens=4097)):
                events.append(item)
        return events

    assert asyncio.run(scenario()) == []


def test_a_long_conversation_is_bounded_by_its_tokens_not_4096_characters(embedded, videos):
    """A follow-up was refused at its 29th turn (4,197 characters, 2,730 prompt tokens of 32,768)."""
    request = _ask(videos, max_new_tokens=2)
    history = [Message.system("Answer briefly. " * 300)]  # 4,800 characters
    request = dataclasses.replace(request, messages=history + request.messages)

    async def scenario():
        return [item async for item in embedded.ask(request) if isinstance(item, AskSummary)][0]

    summary = asyncio.run(scenario())
    assert summary.num_prompt_tokens > 1000 and len(summary.token_ids) == 2


def test_a_stream_stopped_by_the_gateway_ends_the_decoders_run_at_once():
    """When the pipeline stops reading the decoder's steps for an error of its own (a first step
    that differs from the token sent), it ends the decoder's run itself (its batch row and
    reservation freed, in the request's task), not the event loop's finalizer when the generator is
    collected (at once in CPython while nothing else holds it; never while a traceback does)."""
    from epd.gateway.pipeline import Pipeline
    from epd.stages.contracts import PrefillHandle
    from tests.unit.gateway.test_transfer_bytes import Encoder

    class SentFirst(PrefillStage):
        async def prefill(
            self,
            messages,
            media,
            generation,
            request_id,
            pruning=None,
            cache_salt="",
            *,
            raw_prompt=None,
            template=None,
        ):
            return PrefillHandle(first_token_id=7, num_prompt_tokens=20, num_cached_tokens=20,
                                 next_position_ids=[20, 4, 4, 4], kv_num_bytes=64, prefill_ms=1.0,
                                 kv_handle="ab" * 16, first_text=" the")  # fmt: skip

        async def release(self, handle, request_id):
            pass

    class Differs(DecodeStage):
        closed_by_its_caller: bool | None = None

        async def generate(self, handle, generation, request_id, pruning=None):
            caller = asyncio.current_task()
            try:
                yield TokenStep([8], " a")  # not the token prefill sent
                yield TokenStep([9], " b")
            finally:
                # The request's own task closes it; the event loop's finalizer (a task of its own,
                # whenever the generator is collected) did before.
                Differs.closed_by_its_caller = asyncio.current_task() is caller

    async def scenario() -> bool:
        request = AskRequest(question_messages("what colour?"), MediaInput(b"\0"))
        try:
            async for _ in Pipeline(Encoder(0), SentFirst(), Differs()).ask(request):
                pass
        except RuntimeError as exc:
            assert "does not start with the token sent from prefill" in str(exc)
            await asyncio.sleep(0.01)  # a finalizer's task would have run by now
            return bool(Differs.closed_by_its_caller)
        raise AssertionError("the stream did not stop")

    assert asyncio.run(scenario())
