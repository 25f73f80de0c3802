"""DecodeService over gRPC: pull the KV cache, stream tokens."""

from __future__ import annotations

import time

from decode_svc.config import DecodeConfig
from decode_svc.engine import DecodeEngine, stream_tokens
from decode_svc.kv_pull import KvPuller
from model_runtime.sampling import GenerationConfig
from protos.epd.v1 import decode_pb2, decode_pb2_grpc
from stages.model_thread import ModelThread
from transport import convert
from transport.errors import InvalidRequest, Unavailable, rpc_errors

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, config: DecodeConfig, puller: KvPuller, model_thread: ModelThread) -> None:
        self.config = config
        self.puller = puller
        self.model_thread = model_thread
        self.engine: DecodeEngine | None = None  # set once the model is loaded

    @rpc_errors
    async def Generate(self, request, context):
        if self.engine is None:
            raise Unavailable("decode is still loading its model; retry shortly")
        handle = convert.handle_from_proto(request.prefill)
        generation = convert.generation_from_proto(request.generation, GenerationConfig())
        pruning = convert.pruning_from_proto(request.pruning)
        try:
            generation.validate(self.config.max_new_tokens_limit)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        t0 = time.perf_counter()
        cache = await self.puller.pull(handle.kv_address, handle.kv_handle)
        transfer_ms = (time.perf_counter() - t0) * 1e3
        async for step in stream_tokens(
            self.engine, self.model_thread, cache, handle, generation, transfer_ms, pruning
        ):
            msg = decode_pb2.GenerateResponse(
                token_ids=step.token_ids,
                text=step.text,
                finish_reason=step.finish_reason,
                kv_transfer_ms=step.kv_transfer_ms,
                kv_num_bytes=step.kv_num_bytes,
            )
            if step.decode_evict is not None:
                msg.decode_evict.stage = "decode_evict"
                msg.decode_evict.num_visual_tokens_in, msg.decode_evict.num_visual_tokens_out = step.decode_evict
            yield msg
