"""A streamed stage call ends when the request awaiting it is cancelled, at every point: a stage
must not work for nobody until the call's deadline (the gateway's encode call: the encoder decodes
and encodes on; decode's KV pull: prefill streams the cache on).

grpc.aio's streamed read awaits the call's start-up (`_preparation`) outside its own cancel
handler: a reader cancelled just as that start-up completes leaves the call running, uncancelled
(grpcio 1.85). `RemoteEncodeStage` and `KvPuller` cancel their call themselves when its read ends
in any way. Real grpc.aio servers on loopback in this process; the gateway's real `ReplicaPool` and
`RemoteEncodeStage`, the decoder's real `KvPuller`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.decode_svc.kv_pull import KvPuller
from epd.stages.contracts import MediaInput
from epd.transport.remote_encode import RemoteEncodeStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from epd.video.types import SamplingOptions
from tests.unit.plumbing.grpc_fakes import connected

DEADLINE_S = 120.0
"""The calls' deadline: far longer than the wait below, so only a cancel ends a call in time."""
ENDED_WITHIN_S = 30.0


class _SlowStage:
    """Sends one message, then works "forever"; notes when it sent and when its call ended."""

    def __init__(self) -> None:
        self.sent = asyncio.Event()
        self.ended = asyncio.Event()

    async def encode(self, requests, context):
        try:
            async for _ in requests:
                pass
            yield encoder_pb2.EncodeResponse(event=common_pb2.StageEvent(stage="encode", state="started"))
            self.sent.set()
            await asyncio.sleep(DEADLINE_S)
        finally:
            self.ended.set()

    async def pull_kv(self, request, context):
        try:
            yield prefill_pb2.KvChunk(
                tensor=common_pb2.TensorChunk(
                    name="layer.0.key",
                    dtype="float32",
                    shape=[4],
                    total_bytes=16,
                    offset_bytes=0,
                    data=b"\0" * 8,
                )
            )
            self.sent.set()
            await asyncio.sleep(DEADLINE_S)
        finally:
            self.ended.set()


async def _start(stage: _SlowStage) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "epd.v1.EncoderService",
                {
                    "Encode": grpc.stream_stream_rpc_method_handler(
                        stage.encode,
                        encoder_pb2.EncodeRequest.FromString,
                        encoder_pb2.EncodeResponse.SerializeToString,
                    )
                },
            ),
            grpc.method_handlers_generic_handler(
                "epd.v1.PrefillService",
                {
                    "PullKv": grpc.unary_stream_rpc_method_handler(
                        stage.pull_kv,
                        prefill_pb2.PullKvRequest.FromString,
                        prefill_pb2.KvChunk.SerializeToString,
                    )
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _cancel_when_started(
    monkeypatch, module, stub_name: str, method: str, task: dict[str, asyncio.Task]
) -> None:
    """`module.stub_name`'s `method` calls, with the reader's task cancelled the moment the call's
    start-up completes: before the reader resumes from awaiting it (grpc.aio's window)."""
    real_stub = getattr(module, stub_name)

    class Stub(real_stub):  # type: ignore[misc, valid-type]
        def __init__(self, channel) -> None:
            super().__init__(channel)
            real_method = getattr(self, method)

            def call_it(*args, **kwargs):
                call = real_method(*args, **kwargs)
                # Through the channel's interceptors, the call is made in a task of its own.
                call._interceptors_task.add_done_callback(lambda made: watch(made.result()))
                return call

            def watch(call) -> None:
                call._preparation.add_done_callback(lambda _: task["read"].cancel())

            setattr(self, method, call_it)

    monkeypatch.setattr(module, stub_name, Stub)


async def _read_then_cut(read, stage: _SlowStage, cut: str, task: dict[str, asyncio.Task]) -> None:
    task["read"] = asyncio.ensure_future(read)
    if cut == "while-it-works":
        await asyncio.wait_for(stage.sent.wait(), ENDED_WITHIN_S)  # the stage is at work
        task["read"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await task["read"]
    # A bounded wait for an event, not a timing check: without the cancel the call runs on for
    # its whole deadline (DEADLINE_S), 4x longer.
    await asyncio.wait_for(stage.ended.wait(), ENDED_WITHIN_S)


CUTS = ["as-the-call-starts", "while-it-works"]


@pytest.mark.parametrize("cut", CUTS)
def test_a_cancelled_encode_request_ends_its_call_on_the_encoder(monkeypatch, cut):
    async def scenario() -> None:
        stage = _SlowStage()
        server, address = await _start(stage)
        pool = ReplicaPool([address])
        try:
            await connected(pool.channel(address))
            task: dict[str, asyncio.Task] = {}
            if cut == "as-the-call-starts":
                _cancel_when_started(monkeypatch, encoder_pb2_grpc, "EncoderServiceStub", "Encode", task)
            encode = RemoteEncodeStage(pool, DEADLINE_S, max_transfer_bytes=1 << 20).encode(
                MediaInput(b"\0" * 1000), SamplingOptions(), lambda event: None, "req-1"
            )
            await _read_then_cut(encode, stage, cut, task)
        finally:
            await pool.close()
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("cut", CUTS)
def test_a_cancelled_kv_pull_ends_its_call_on_prefill(monkeypatch, cut):
    async def scenario() -> None:
        stage = _SlowStage()
        server, address = await _start(stage)
        puller = KvPuller(("127.0.0.1:*",), 1 << 20, DEADLINE_S)
        try:
            task: dict[str, asyncio.Task] = {}
            if cut == "as-the-call-starts":
                _cancel_when_started(monkeypatch, prefill_pb2_grpc, "PrefillServiceStub", "PullKv", task)
            await _read_then_cut(puller.pull(address, "handle"), stage, cut, task)
        finally:
            await puller.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_the_window_is_grpcs_own():
    """The hook above reaches grpc.aio's private start-up task: if a grpcio release renames it,
    this says so rather than the tests above failing obscurely."""
    from grpc.aio import _call

    assert "_preparation" in _call._StreamResponseMixin.__annotations__
