"""Stages that call the gRPC services: the gateway's view of the disaggregated stack.

Each stage holds one channel per replica address and picks replicas round-robin (client-side
load balancing; in Kubernetes the addresses come from a headless Service).

Tensors pass through in wire form (`epd.transport.tensor_wire.WireTensor`): the gateway relays the
encoder's embeddings to prefill and prefill's visual-entry mask to decode without torch.

Cancelling a stage call (the gateway's request task is cancelled when its client goes away)
cancels the RPC, and the service's handler is cancelled in turn. A KV cache is released at the
prefill replica that holds it, by the address that replica advertised (`kv_address`), since a
replica pool's channel may balance a call to another replica.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence

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


class ReplicaPool:
    """Round-robin over channels to the replicas of one stage."""

    def __init__(self, addresses: list[str]) -> None:
        if not addresses:
            raise ValueError("a stage needs at least one address")
        self.addresses = list(addresses)
        # round_robin: a `dns:///name-headless:port` target spreads calls over every replica
        # behind the name (gRPC's default pick_first would send all of them to one).
        options = [*channel_options(), *RECONNECT_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
        self.channels = [grpc.aio.insecure_channel(a, options=options) for a in addresses]
        self._next = itertools.cycle(range(len(self.channels)))

    def pick(self) -> grpc.aio.Channel:
        return self.channels[next(self._next)]

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


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

        stub = encoder_pb2_grpc.EncoderServiceStub(self.pool.pick())
        asm = TensorAssembler(self.max_transfer_bytes)
        result = None
        try:
            async for msg in stub.Encode(requests(), timeout=self.timeout_s):
                kind = msg.WhichOneof("kind")
                if kind == "event":
                    on_event(convert.event_from_proto(msg.event))
                elif kind == "embeddings":
                    asm.add(msg.embeddings)
                else:
                    result = msg.result
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "encode", request_id) from None
        if result is None:
            raise UpstreamError(grpc.StatusCode.INTERNAL, "the encoder ended without a result")
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

        stub = prefill_pb2_grpc.PrefillServiceStub(self.pool.pick())
        try:
            result = await stub.Prefill(requests(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise stage_error(exc, "prefill", request_id) from None
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
