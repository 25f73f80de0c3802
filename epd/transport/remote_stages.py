"""Stages that call the gRPC services: the gateway's view of the disaggregated stack.

Each stage holds one channel per replica address (client-side load balancing; in Kubernetes the
addresses come from a headless Service). A call about media goes to the replica that rendezvous
hashing of the media's sha256 picks among the healthy ones (`epd.transport.affinity`), so the
encoder replica whose token cache holds a video and the prefill replica whose prefix cache holds
its conversation get every request about it; a call without media goes round robin. A call that
fails with UNAVAILABLE (replica gone, draining or not reachable) is tried once more on the next
replica in that order: a cache miss there, the same answer.

Tensors pass through in wire form (`epd.transport.tensor_wire.WireTensor`): the gateway relays the
encoder's embeddings to prefill and prefill's visual-entry mask to decode without torch.

Cancelling a stage call (the gateway's request task is cancelled when its client goes away)
cancels the RPC, and the service's handler is cancelled in turn. A KV cache is released at the
prefill replica that holds it, by the address that replica advertised (`kv_address`), since a
replica pool's channel may balance a call to another replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import (
    DecodeStage,
    EncodedMedia,
    EncodeStage,
    EventSink,
    MediaInput,
    PrefillHandle,
    PrefillStage,
    TokenStep,
)
from epd.stages.errors import InvalidRequest
from epd.stages.messages import Message
from epd.stages.server_config import CHUNK_BYTES
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.affinity import FAILURE_HOLD_S, ReplicaChooser
from epd.transport.errors import UpstreamError, stage_error
from epd.transport.server import RECONNECT_OPTIONS, channel_options
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_TRIES = 2
"""Replicas one call tries: its first choice, then once the next one if the first was UNAVAILABLE."""

HASH_IN_THREAD_BYTES = 1 << 20
"""Uploads at least this large are hashed (for routing) off the event loop."""


class ReplicaPool:
    """Channels to the replicas of one stage and the order a call tries them in
    (`epd.transport.affinity.ReplicaChooser`: by media sha256, else round robin)."""

    def __init__(self, addresses: list[str], failure_hold_s: float = FAILURE_HOLD_S) -> None:
        if not addresses:
            raise ValueError("a stage needs at least one address")
        self.addresses = list(addresses)
        # round_robin: a `dns:///name-headless:port` target spreads calls over every replica
        # behind the name (gRPC's default pick_first would send all of them to one).
        options = [*channel_options(), *RECONNECT_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
        self.channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self._by_address = dict(zip(self.addresses, self.channels))
        self.chooser = ReplicaChooser(self.addresses, failure_hold_s)

    def pick(self, key: str = "") -> grpc.aio.Channel:
        """The channel a call with affinity `key` ("" = none) goes to first."""
        return self._by_address[self.chooser.order(key)[0]]

    def candidates(self, key: str = "", max_tries: int = MAX_TRIES) -> list[tuple[str, grpc.aio.Channel]]:
        """(address, channel) of the replicas one call may try, best first."""
        return [(a, self._by_address[a]) for a in self.chooser.order(key)[:max_tries]]

    def set_serving(self, address: str, serving: bool) -> None:
        """A health check's answer (the gateway's stage checks, epd/gateway/readiness.py)."""
        self.chooser.set_serving(address, serving)

    def mark_failed(self, address: str) -> None:
        self.chooser.mark_failed(address)

    async def call(
        self,
        key: str,
        attempt: Callable[[grpc.aio.Channel], Awaitable[T]],
        stage: str,
        request_id: str,
    ) -> T:
        """`attempt(channel)` on the first choice for `key`; when it fails with UNAVAILABLE, once
        more on the next replica (a fresh attempt: the caller rebuilds its request stream). Any
        other failure, or the last try's, is the stage's error."""
        tries = self.candidates(key)
        for i, (address, channel) in enumerate(tries):
            try:
                return await attempt(channel)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise stage_error(exc, stage, request_id) from None
                self.mark_failed(address)
                if i + 1 == len(tries):
                    raise stage_error(exc, stage, request_id) from None
                log.warning("%s replica %s unavailable for request %s (%s); trying %s",
                            stage, address, request_id, exc.details(), tries[i + 1][0])
        raise AssertionError("unreachable: a pool has at least one replica")

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


async def media_key(media: MediaInput, pool: ReplicaPool) -> str:
    """The affinity key of a media upload: its sha256 (hashed here when the client sent none and
    there is a choice to make; the encoder's token cache is keyed by the same hash)."""
    if media.sha256 or not media.data or len(pool.addresses) < 2:
        return media.sha256
    data = media.data
    if len(data) < HASH_IN_THREAD_BYTES:
        return hashlib.sha256(data).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())


class RemoteEncodeStage(EncodeStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float, max_transfer_bytes: int) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.max_transfer_bytes = max_transfer_bytes

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        data = media.data or b""

        async def requests():
            yield encoder_pb2.EncodeRequest(
                header=encoder_pb2.EncodeHeader(
                    request_id=request_id,
                    media_num_bytes=len(data),
                    sampling=convert.sampling_to_proto(sampling),
                    media_sha256=media.sha256,
                    pruning=convert.pruning_to_proto(pruning),
                )
            )
            for i in range(0, len(data), CHUNK_BYTES):
                yield encoder_pb2.EncodeRequest(media_chunk=data[i : i + CHUNK_BYTES])

        async def attempt(channel: grpc.aio.Channel) -> tuple[encoder_pb2.EncodeResult, TensorAssembler]:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            asm = TensorAssembler(self.max_transfer_bytes)
            result = None
            async for msg in stub.Encode(requests(), timeout=self.timeout_s):
                kind = msg.WhichOneof("kind")
                if kind == "event":
                    on_event(convert.event_from_proto(msg.event))
                elif kind == "embeddings":
                    asm.add(msg.embeddings)
                else:
                    result = msg.result
            if result is None:
                raise UpstreamError(grpc.StatusCode.INTERNAL, "the encoder ended without a result")
            return result, asm

        key = await media_key(media, self.pool)
        result, asm = await self.pool.call(key, attempt, "encode", request_id)
        # Relayed to prefill as received (embeddings and any DeepStack features, all counted
        # against max_transfer_bytes): wire form, no torch in the gateway.
        return convert.encoded_media_from_proto(result, asm.wire_tensors())


class RemotePrefillStage(PrefillStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self._kv_channels: dict[str, grpc.aio.Channel] = {}  # by kv_address, for ReleaseKv

    async def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> PrefillHandle:
        async def requests():
            yield prefill_pb2.PrefillRequest(
                header=prefill_pb2.PrefillHeader(
                    request_id=request_id,
                    messages=convert.messages_to_proto(messages),
                    visual=convert.encode_result_to_proto(media),
                    generation=convert.generation_to_proto(generation),
                    pruning=convert.pruning_to_proto(pruning),
                )
            )
            for chunk in convert.encoded_media_chunks(media):  # embeddings + DeepStack features
                yield prefill_pb2.PrefillRequest(visual_embeds=chunk)

        async def attempt(channel: grpc.aio.Channel) -> prefill_pb2.PrefillResult:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            return await stub.Prefill(requests(), timeout=self.timeout_s)

        # The replica whose prefix cache holds this video's conversation (rendezvous on its sha256).
        result = await self.pool.call(media.sha256, attempt, "prefill", request_id)
        return convert.handle_from_proto(result, relay=True)

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        if not handle.kv_address:
            return
        channel = self._kv_channels.get(handle.kv_address)
        if channel is None:
            # The address came from our own prefill server's answer, never from a client.
            channel = grpc.aio.insecure_channel(handle.kv_address, options=channel_options())
            self._kv_channels[handle.kv_address] = channel
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        try:
            request = prefill_pb2.ReleaseKvRequest(kv_handle=handle.kv_handle, request_id=request_id)
            await stub.ReleaseKv(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "prefill", request_id) from None


class RemoteDecodeStage(DecodeStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        if not handle.kv_address:
            raise InvalidRequest("a remote decoder needs the prefill server's kv_address")
        stub = decode_pb2_grpc.DecodeServiceStub(self.pool.pick())
        request = decode_pb2.GenerateRequest(
            request_id=request_id,
            prefill=convert.handle_to_proto(handle),
            generation=convert.generation_to_proto(generation),
            pruning=convert.pruning_to_proto(pruning),
        )
        try:
            async for msg in stub.Generate(request, timeout=self.timeout_s):
                yield convert.token_step_from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "decode", request_id) from None
