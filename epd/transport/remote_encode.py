"""The encode stage over gRPC: a media upload streamed in chunks to an encoder replica that
`ReplicaPool` picks, its events and tensors read back; and a media upload's affinity key, by which
the encoder replica is picked (prefill's early structured-output compile uses it too).

Tensors pass through in wire form (`epd.transport.tensor_wire.WireTensor`): the gateway relays the
encoder's embeddings to prefill without torch.
"""

from __future__ import annotations

import asyncio
import hashlib

import grpc

from epd.stages.contracts import EncodedMedia, EncodeStage, EventSink, MediaInput
from epd.stages.server_config import CHUNK_BYTES
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.errors import UpstreamError
from epd.transport.replica_pool import ReplicaPool
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import encoder_pb2, encoder_pb2_grpc
from epd.video.types import SamplingOptions

HASH_IN_THREAD_BYTES = 1 << 20
"""Uploads at least this large are hashed (for routing) off the event loop."""


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

    async def close(self) -> None:
        """Close the pool's channels (idempotent); the stage takes no call after it."""
        await self.pool.close()

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
        priority: int = 0,
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
                    cache_salt=cache_salt,
                    priority=priority,
                )
            )
            for i in range(0, len(data), CHUNK_BYTES):
                yield encoder_pb2.EncodeRequest(media_chunk=data[i : i + CHUNK_BYTES])

        async def attempt(
            channel: grpc.aio.Channel, timeout_s: float
        ) -> tuple[encoder_pb2.EncodeResult, TensorAssembler]:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel)
            asm = TensorAssembler(self.max_transfer_bytes)
            result = None
            call = stub.Encode(requests(), timeout=timeout_s)
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "event":
                        on_event(convert.event_from_proto(msg.event))
                    elif kind == "embeddings":
                        asm.add(msg.embeddings)
                    else:
                        result = msg.result
            finally:
                # No-op once the call ended. A reader cancelled just as the call's start-up
                # completes leaves it running (grpc.aio awaits that start outside its cancel
                # handler): the encoder would decode and encode for nobody until the deadline.
                call.cancel()
            if result is None:
                raise UpstreamError(grpc.StatusCode.INTERNAL, "the encoder ended without a result")
            return result, asm

        key = await media_key(media, self.pool)
        result, asm = await self.pool.call(key, attempt, "encode", request_id, self.timeout_s)
        # Relayed to prefill as received (embeddings and any DeepStack features, all counted
        # against max_transfer_bytes): wire form, no torch in the gateway.
        encoded = convert.encoded_media_from_proto(result, asm.wire_tensors())
        # Hop encoder -> gateway of the request's transfer_bytes (a token-cache hit sends them too).
        encoded.pruning.transfer_bytes = asm.total_bytes
        return encoded
