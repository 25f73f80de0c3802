"""No KV cache is left at prefill however a request ends: the client going away at any stage
event, a cancel that lands as prefill's answer arrives (on the gateway's side, the server's and the
remote caller's), a malformed prefill answer, a decoder that fails before pulling or is lost after
its first token. The embedded pipeline with the real tiny model; real gRPC servers in this process
where the race is on the wire.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from contextlib import aclosing

import pytest

from epd.gateway.ask_types import AskSummary
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import DecodeStage, PrefillStage, StageEvent, TokenStep
from epd.stages.errors import InvalidRequest
from tests.unit.plumbing.pipeline_asks import _ask


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
