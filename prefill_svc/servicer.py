"""PrefillService over gRPC: Prefill is protobuf in (the visual embeddings' upload), a
PrefillStage call, protobuf out (the stage's PrefillHandle, after its prompt logprobs in pieces);
PullKv streams a cache to a decoder; ReleaseKv drops one: confirmed by the decoder that has it
(`received`), or released by the gateway because its request ended before a decoder had it;
CompileStructuredOutputs compiles a request's constraint while its media is encoded, so that its
Prefill finds it compiled; GetModelInfo says what the loaded model and this server's limits take
(the gateway reads it: epd/gateway/model_info.py); Tokenize and Detokenize serve the HTTP API's
/tokenize and /detokenize with the model's tokenizer.

Handover in two steps (`KvStore.lease` / `confirm`): a decoder's PullKv (`keep_until_confirmed`)
leaves the cache in the store, so a pull that breaks half way, or a decoder that dies before it
holds the whole cache, loses nothing: the gateway's retry on another decoder pulls it again. The
cache goes at the decoder's confirmation, the gateway's release, or the TTL (`--kv-ttl`),
whichever comes first; the TTL bounds what dead decoders and gateways leave behind.

A caller that goes away during Prefill cancels the handler: the request leaves the prefill
core's queue at once (or stops between its chunks), and a finished one's cache is not stored
(`LocalPrefillStage`); one that goes away as the answer leaves gets its stored cache released
when the RPC ends cancelled."""

from __future__ import annotations

import logging
import time

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.kv_store import KvStore, check_handle
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.contracts import MediaInput, check_cache_salt
from epd.stages.deadline import set_client_deadline
from epd.stages.errors import InvalidRequest, Unavailable
from epd.transport import convert, tracing
from epd.transport.errors import rpc_errors
from epd.transport.model_info import model_info_to_proto, tokenize_input_from_proto, tokenize_output_to_proto
from epd.transport.tensor_wire import TensorAssembler, tensor_to_chunks
from epd.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, config: PrefillConfig, kv_store: KvStore) -> None:
        self.config = config
        self.kv_store = kv_store
        self.stage: LocalPrefillStage | None = None  # set once the model is loaded

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
        # "visual_embeds" and the DeepStack features the header names, one byte budget for all;
        # no `visual` at all: a text-only conversation (the engine checks its messages agree)
        media = None
        if header.HasField("visual"):
            media = convert.encoded_media_from_proto(header.visual, embeds.tensors())
        elif embeds.tensors():
            raise InvalidRequest("visual_embeds were sent without the header's visual metadata; set visual")
        generation = convert.generation_from_proto(header.generation, GenerationConfig())
        pruning = convert.pruning_from_proto(header.pruning)
        messages = convert.messages_from_proto(header.messages)
        raw_prompt = (
            convert.raw_prompt_from_proto(header.raw_prompt) if header.HasField("raw_prompt") else None
        )
        template = convert.template_from_proto(header.template)
        request_id = tracing.adopt_request_id(header.request_id)
        cache_salt = check_cache_salt(header.cache_salt)  # the tenant, set by the gateway
        kv_handle = check_handle(header.kv_handle)
        set_client_deadline(context.time_remaining())  # the render's checks read it (None: none)
        handle = await self.stage.prefill(
            messages,
            media,
            generation,
            request_id,
            pruning,
            cache_salt,
            kv_handle,
            raw_prompt=raw_prompt,
            template=template,
        )
        # A caller that goes away as the answer goes out never gets the handle, so nobody would
        # release the stored cache before its TTL: the RPC's end says whether the answer got out.
        # So does an answer that failed on its way (a piece or the result that could not be made
        # or sent): the RPC ends with an error, not cancelled, and the caller has no handle either.
        answered = [False]  # the result, the stream's last message, handed to gRPC
        context.add_done_callback(self._release_unless_answered(handle.kv_handle, request_id, answered))
        tracing.stage_timings(
            log,
            "prefill done",
            prefill_ms=handle.prefill_ms,
            num_prompt_tokens=handle.num_prompt_tokens,
            num_reused_prompt_tokens=handle.num_reused_prompt_tokens,
            kv_num_bytes=handle.kv_num_bytes,
        )
        async for response in convert.prefill_responses(handle):  # the prompt's logprobs first, in pieces
            yield response
        answered[0] = True

    def _release_unless_answered(self, kv_handle: str, request_id: str, answered: list[bool]):
        def done(context) -> None:
            if (context.cancelled() or not answered[0]) and self.kv_store.release(kv_handle):
                why = "its caller went away" if context.cancelled() else "its answer failed"
                log.info("released the KV cache of request %s: %s before the answer", request_id, why)

        return done

    @rpc_errors
    async def PullKv(self, request, context):
        started = time.perf_counter()
        if request.keep_until_confirmed:
            cache, num_leases = self.kv_store.lease(request.kv_handle)
            if num_leases > 1:
                log.info(
                    "KV cache %s pulled again (pull %d): an earlier pull broke or was not confirmed",
                    request.kv_handle,
                    num_leases,
                )
        else:  # a decoder that will not confirm: the cache is handed over as it leaves
            cache = self.kv_store.take(request.kv_handle)
        num_bytes = 0
        for name, tensor in cache.named_tensors():
            for chunk in tensor_to_chunks(name, tensor):
                num_bytes += len(chunk.data)
                yield prefill_pb2.KvChunk(tensor=chunk)
        tracing.stage_timings(
            log, "kv pull served", kv_num_bytes=num_bytes, send_ms=(time.perf_counter() - started) * 1e3
        )

    @rpc_errors
    async def ReleaseKv(self, request, context):
        request_id = tracing.adopt_request_id(request.request_id)
        if request.received:
            released = self.kv_store.confirm(request.kv_handle)
            if released:
                log.info("KV cache of request %s handed over: its decoder confirmed receipt", request_id)
        else:
            released = self.kv_store.release(request.kv_handle)
            if released:
                log.info(
                    "released the KV cache of request %s: it ended before a decoder pulled it", request_id
                )
        return prefill_pb2.ReleaseKvResult(
            released=released, num_kv_caches_held=len(self.kv_store), kv_bytes_held=self.kv_store.num_bytes
        )

    def _loaded(self) -> LocalPrefillStage:
        if self.stage is None:
            raise Unavailable("prefill is still loading its model; retry shortly")
        return self.stage

    @rpc_errors
    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self._loaded().model_info())

    @rpc_errors
    async def Tokenize(self, request, context):
        request_id = tracing.adopt_request_id(request.request_id)
        set_client_deadline(context.time_remaining())  # the render's checks read it (None: none)
        return tokenize_output_to_proto(
            await self._loaded().tokenize(tokenize_input_from_proto(request), request_id)
        )

    @rpc_errors
    async def CompileStructuredOutputs(self, request, context):
        request_id = tracing.adopt_request_id(request.request_id)
        if not request.HasField("structured_outputs"):
            raise InvalidRequest("set structured_outputs: the constraint to compile")
        spec = convert.structured_from_proto(request.structured_outputs)
        await self._loaded().compile_structured_outputs(spec, [], MediaInput(None), request_id)
        return prefill_pb2.CompileStructuredOutputsResult()

    @rpc_errors
    async def Detokenize(self, request, context):
        text = await self._loaded().detokenize(
            list(request.token_ids), tracing.adopt_request_id(request.request_id)
        )
        return prefill_pb2.DetokenizeResult(text=text)
