"""EncoderService over gRPC: protobuf in, EncodeStage call, protobuf out."""

from __future__ import annotations

import logging
import time

from epd.encoder_svc.config import EncoderConfig
from epd.stages.contracts import EncodeStage, check_cache_salt
from epd.stages.errors import Unavailable
from epd.stages.events import Finished, with_events
from epd.transport import convert, tracing
from epd.transport.errors import rpc_errors
from epd.transport.upload import media_input, read_upload
from epd.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self.stage: EncodeStage | None = None  # set once the model is loaded

    @rpc_errors
    async def Encode(self, request_iterator, context):
        started = time.perf_counter()
        if self.stage is None:
            raise Unavailable("the encoder is still loading its model; retry shortly")
        header, data = await read_upload(request_iterator, self.config.limits.max_bytes)
        sampling = convert.sampling_from_proto(header.sampling, self.config.sampling)
        media = media_input(header, data)
        stage = self.stage

        pruning = convert.pruning_from_proto(header.pruning)
        request_id = tracing.adopt_request_id(header.request_id)
        cache_salt = check_cache_salt(header.cache_salt)  # the tenant, set by the gateway
        async for item in with_events(
            lambda sink: stage.encode(media, sampling, sink, request_id, pruning, cache_salt, header.priority)
        ):
            if isinstance(item, Finished):
                encoded = item.value
                tracing.stage_timings(
                    log,
                    "encode done",
                    video_decode_ms=encoded.decode_ms,
                    encode_ms=encoded.encode_ms,
                    total_ms=(time.perf_counter() - started) * 1e3,
                    num_frames=encoded.num_frames,
                    num_visual_tokens=encoded.meta.num_visual_tokens,
                    cache_hit=encoded.cache_hit,
                )
                for chunk in convert.encoded_media_chunks(encoded):  # embeddings + DeepStack features
                    yield encoder_pb2.EncodeResponse(embeddings=chunk)
                yield encoder_pb2.EncodeResponse(result=convert.encode_result_to_proto(encoded))
            else:
                at_ms = (time.perf_counter() - started) * 1e3
                yield encoder_pb2.EncodeResponse(event=convert.event_to_proto(item, at_ms))
