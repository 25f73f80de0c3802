"""PrefillService over gRPC: Prefill is protobuf in (the visual embeddings' upload), a
PrefillStage call, protobuf out (the stage's PrefillHandle); PullKv hands caches over; ReleaseKv
drops one whose request ended before a decoder pulled it.

A caller that goes away during Prefill cancels the handler: the request leaves the prefill
core's queue at once (or stops between its chunks), and a finished one's cache is not stored
(`LocalPrefillStage`)."""

from __future__ import annotations

import logging

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import PrefillStage
from epd.stages.errors import InvalidRequest, Unavailable
from epd.transport import convert
from epd.transport.errors import rpc_errors
from epd.transport.tensor_wire import TensorAssembler, tensor_to_chunks
from epd.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, config: PrefillConfig, kv_store: KvStore) -> None:
        self.config = config
        self.kv_store = kv_store
        self.stage: PrefillStage | None = None  # set once the model is loaded

    @rpc_errors
    async def Prefill(self, request_iterator, context):
        if self.stage is None:
            raise Unavailable("prefill is still loading its model; retry shortly")
        header = None
        embeds = TensorAssembler(self.config.max_transfer_bytes)
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if header is None:
                if kind != "header":
                    raise InvalidRequest("the first message of the stream must be the header")
                header = msg.header
            elif kind == "visual_embeds":
                embeds.add(msg.visual_embeds)
            else:
                raise InvalidRequest("only visual_embeds messages may follow the header")
        if header is None:
            raise InvalidRequest("the stream ended before its header")
        # "visual_embeds" and the DeepStack features the header names, one byte budget for all
        media = convert.encoded_media_from_proto(header.visual, embeds.tensors())
        generation = convert.generation_from_proto(header.generation, GenerationConfig())
        pruning = convert.pruning_from_proto(header.pruning)
        messages = convert.messages_from_proto(header.messages)
        handle = await self.stage.prefill(messages, media, generation, header.request_id, pruning)
        return convert.handle_to_proto(handle)

    @rpc_errors
    async def PullKv(self, request, context):
        cache = self.kv_store.take(request.kv_handle)
        for name, tensor in cache.named_tensors():
            for chunk in tensor_to_chunks(name, tensor):
                yield prefill_pb2.KvChunk(tensor=chunk)

    @rpc_errors
    async def ReleaseKv(self, request, context):
        released = self.kv_store.release(request.kv_handle)
        if released:
            log.info("released the KV cache of request %s: it ended before a decoder pulled it",
                     request.request_id or "?")
        return prefill_pb2.ReleaseKvResult(
            released=released, num_kv_caches_held=len(self.kv_store), kv_bytes_held=self.kv_store.num_bytes
        )
