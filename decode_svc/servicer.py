"""DecodeService over gRPC: pull the KV cache, stream tokens.

A client that goes away cancels this handler (gRPC cancels its task): a pull in flight is cancelled
(the prefill side has already forgotten the cache), and generation stops before its next step
with the cache freed (`stream_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine, stream_tokens
from epd.decode_svc.kv_pull import KvPuller
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import TokenStep
from epd.stages.errors import InvalidRequest, Unavailable
from epd.stages.model_thread import ModelThread
from epd.transport import convert
from epd.transport.errors import rpc_errors
from epd.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

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
        num_tokens = 0
        try:
            t0 = time.perf_counter()
            cache = await self.puller.pull(handle.kv_address, handle.kv_handle)
            transfer_ms = (time.perf_counter() - t0) * 1e3
            tokens = stream_tokens(self.engine, self.model_thread, cache, handle, generation, transfer_ms, pruning)
            del cache  # the token stream owns it now and frees it when it ends
            async with aclosing(tokens):
                async for step in tokens:
                    num_tokens += len(step.token_ids)
                    yield _response(step)
        except asyncio.CancelledError:
            log.info("generation of request %s cancelled by its caller after %d tokens; its KV cache is freed",
                     request.request_id, num_tokens)
            raise


def _response(step: TokenStep) -> decode_pb2.GenerateResponse:
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
    return msg
