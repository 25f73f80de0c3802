"""DecodeService over gRPC: protobuf in, DecodeStage call, protobuf out.

The stage pulls the KV cache from the prefill server the request names (`KvPuller.take_kv`) and
streams the tokens. A client that goes away (the gateway cancels the call, or dies: its connection
drops) cancels this handler (gRPC cancels its task): a pull in flight is cancelled (prefill keeps
the cache until the gateway releases it or its TTL), and generation stops before its next step
with the cache and the request's row freed (`LocalDecodeStage`).
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import DecodeStage
from epd.stages.errors import InvalidRequest, Unavailable
from epd.transport import convert, tracing
from epd.transport.errors import rpc_errors
from epd.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.stage: DecodeStage | None = None  # set once the model is loaded

    @rpc_errors
    async def Generate(self, request, context):
        if self.stage is None:
            raise Unavailable("decode is still loading its model; retry shortly")
        handle = convert.handle_from_proto(request.prefill)
        generation = convert.generation_from_proto(request.generation, GenerationConfig())
        if generation.n != 1:
            raise InvalidRequest(
                f"generation.n is {generation.n}, but a decode request is one choice: send one request per "
                "choice, each with the prefill result's first token for it (n 1 or unset)"
            )
        pruning = convert.pruning_from_proto(request.pruning)
        request_id = tracing.adopt_request_id(request.request_id)
        started = time.perf_counter()
        kv_transfer_ms, ttft_ms, num_tokens, finish_reason = 0.0, 0.0, 0, ""
        tokens = self.stage.generate(handle, generation, request_id, pruning)
        async with aclosing(tokens):
            async for step in tokens:
                if not num_tokens:
                    kv_transfer_ms, ttft_ms = step.kv_transfer_ms, (time.perf_counter() - started) * 1e3
                num_tokens += len(step.token_ids)
                finish_reason = step.finish_reason or finish_reason
                yield convert.token_step_to_proto(step)
        tracing.stage_timings(
            log,
            "decode done",
            kv_transfer_ms=kv_transfer_ms,
            first_token_ms=ttft_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
            num_tokens=num_tokens,
            finish_reason=finish_reason,
        )
