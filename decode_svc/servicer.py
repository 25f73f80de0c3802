"""DecodeService over gRPC: protobuf in, DecodeStage call, protobuf out.

The stage pulls the KV cache from the prefill server the request names (`KvPuller.take_kv`) and
streams the tokens. A client that goes away cancels this handler (gRPC cancels its task): a pull
in flight is cancelled (the prefill side has already forgotten the cache), and generation stops
before its next step with the cache freed (`LocalDecodeStage`).
"""

from __future__ import annotations

from contextlib import aclosing

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import DecodeStage
from epd.stages.errors import Unavailable
from epd.transport import convert
from epd.transport.errors import rpc_errors
from epd.v1 import decode_pb2, decode_pb2_grpc

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
        pruning = convert.pruning_from_proto(request.pruning)
        tokens = self.stage.generate(handle, generation, request.request_id, pruning)
        async with aclosing(tokens):
            async for step in tokens:
                yield convert.token_step_to_proto(step)
