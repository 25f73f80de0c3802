"""The prefill stage over gRPC: Prefill, CompileStructuredOutputs, ReleaseKv, Tokenize and
Detokenize on the prefill replica that `ReplicaPool` picks.

Tensors pass through in wire form (`epd.transport.tensor_wire.WireTensor`): the gateway relays the
encoder's embeddings to prefill and prefill's visual-entry mask to decode without torch.

A KV cache is released at the prefill replica that holds it, by the address that replica advertised
(`kv_address`), since a replica address may stand for several (a plain name gRPC balances over); a
call whose caller got no handle (cancelled, or answered malformed) releases the cache it may have
stored on its own replica.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import grpc

from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.contracts import EncodedMedia, MediaInput, PrefillHandle, PrefillStage
from epd.stages.messages import ChatTemplateOptions, Message
from epd.stages.model_info import ModelInfo
from epd.stages.raw_prompt import RawPrompt
from epd.stages.request_id import current_request_id
from epd.stages.tokenize import TokenizeInput, TokenizeOutput
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.affinity import prefill_key, raw_prompt_key
from epd.transport.aio_cancel import within
from epd.transport.channel_cache import ChannelCache
from epd.transport.errors import UpstreamError, stage_error
from epd.transport.model_info import fetch_model_info, tokenize_output_from_proto, tokenize_request_to_proto
from epd.transport.remote_encode import media_key
from epd.transport.replica_pool import ReplicaPool
from epd.transport.server import traced_channel
from epd.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)

CONSTRAINT_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""What prefill's CompileStructuredOutputs answers for the constraint itself (it does not compile;
too many slow compiles run: retry later), which refuses the request; any other status (a replica
lost, one that predates the call: UNIMPLEMENTED) leaves the compile to the request's Prefill."""

_unanswered_releases: set[asyncio.Future] = set()
"""ReleaseKv calls for prefill calls whose caller got no handle (cancelled, or answered malformed),
running on their own (held so they are not collected)."""


def _release_unanswered(
    stub: prefill_pb2_grpc.PrefillServiceStub, kv_handle: str, request_id: str, why: str, timeout_s: float
) -> asyncio.Future:
    """ReleaseKv of the cache a prefill call may have stored under the caller's `kv_handle`, on the
    call's own replica, running on its own (a cancel of the caller does not stop it); logged when it
    released one (`why`: how the call ended) or failed."""
    release = asyncio.ensure_future(
        stub.ReleaseKv(
            prefill_pb2.ReleaseKvRequest(kv_handle=kv_handle, request_id=request_id), timeout=timeout_s
        )
    )
    _unanswered_releases.add(release)

    def done(release: asyncio.Future) -> None:
        _unanswered_releases.discard(release)
        if release.cancelled():
            return
        if (exc := release.exception()) is not None:
            log.warning("request %s: releasing the KV cache of its prefill call failed: %s", request_id, exc)
        elif release.result().released:
            log.info("released the KV cache of request %s: its prefill call %s", request_id, why)

    release.add_done_callback(done)
    return release


class RemotePrefillStage(PrefillStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        # By kv_address, for ReleaseKv. The address came from our own prefill server's answer,
        # never from a client. A pod advertises its IP, which no certificate names: when the IP is
        # (or was: a draining pod leaves DNS with caches) a replica the gateway resolved from a
        # `dns:///` name, its certificate is checked against that name. Bounded: prefill pods are
        # replaced, and each new IP would keep a channel for good.
        self.kv_channels = ChannelCache(
            lambda address: traced_channel(address, server_name=self.pool.server_name(address))
        )
        self._known_model_info: ModelInfo | None = None
        self._model_info_known = asyncio.Event()

    async def prefill(
        self,
        messages: Sequence[Message],
        media: EncodedMedia | None,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
        *,
        raw_prompt: RawPrompt | None = None,
        template: ChatTemplateOptions = ChatTemplateOptions(),
    ) -> PrefillHandle:
        # Ours, not the server's: a call cancelled here may have been answered (the server then saw
        # it end well and keeps the cache for its decoder); released by this handle, it does not
        # stay stored until --kv-ttl.
        kv_handle = uuid.uuid4().hex

        async def requests():
            yield prefill_pb2.PrefillRequest(
                header=prefill_pb2.PrefillHeader(
                    request_id=request_id,
                    messages=convert.messages_to_proto(messages),
                    # unset: text alone
                    visual=None if media is None else convert.encode_result_to_proto(media),
                    generation=convert.generation_to_proto(generation),
                    pruning=convert.pruning_to_proto(pruning),
                    cache_salt=cache_salt,
                    kv_handle=kv_handle,
                    raw_prompt=None if raw_prompt is None else convert.raw_prompt_to_proto(raw_prompt),
                    template=convert.template_to_proto(template),
                )
            )
            if media is not None:
                for chunk in convert.encoded_media_chunks(media):  # embeddings + DeepStack features
                    yield prefill_pb2.PrefillRequest(visual_embeds=chunk)

        async def attempt(
            channel: grpc.aio.Channel, timeout_s: float
        ) -> tuple[PrefillHandle, prefill_pb2.PrefillResult]:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            call = stub.Prefill(requests(), timeout=timeout_s)
            answer = convert.PrefillAnswer()
            try:
                async for response in call:  # the prompt's logprobs in pieces, then the result
                    await answer.add(response)
                handle = answer.handle(relay=True)
                assert answer.result is not None  # `handle` refuses an answer without it
                return handle, answer.result
            except asyncio.CancelledError:
                _release_unanswered(
                    stub, kv_handle, request_id, "was cancelled as it was answered", self.timeout_s
                )
                raise
            except RuntimeError:
                # A malformed answer (`PrefillAnswer`): the server sent it whole, or we stopped
                # reading it, and keeps the cache it stored under our handle (whether or not the
                # answer names it) for a decoder that will never come: released now, not at
                # --kv-ttl. Awaited, so that the request ends with nothing held; the call first
                # stops, so that the server sends no more.
                call.cancel()
                release = _release_unanswered(
                    stub, kv_handle, request_id, "answered malformed", self.timeout_s
                )
                await asyncio.wait([release])  # unlike await, neither raises its error nor cancels it
                raise
            finally:
                if not call.done():  # a cancel: the server stops sending now
                    call.cancel()

        # The replica whose prefix cache holds this conversation (rendezvous on the video's sha256
        # when the conversation opens with it, else on its opening), or a raw prompt (on its beginning).
        # Not on `template`: a continued message's prompt shares its conversation's token prefix. Nor
        # on its tools: a template that renders them puts them ahead of the conversation, so other
        # tools share no prefix through the video or the opening anywhere, and one that ignores them
        # renders the same prompt with any (affinity's module doc).
        if raw_prompt is not None:
            key = raw_prompt_key(raw_prompt, cache_salt)
        else:
            key = prefill_key(messages, media.sha256 if media else "", cache_salt)
        handle, result = await self.pool.call(key, attempt, "prefill", request_id, self.timeout_s)
        # This call's hops of the request's transfer_bytes: the media's tensors gateway -> prefill
        # (sent whole, prefix-cache hit or not: prefill hashes them for its key), and the
        # visual-entry mask (decode eviction only) prefill -> gateway, then gateway -> decode in
        # the GenerateRequest.
        media_num_bytes = convert.encoded_media_num_bytes(media) if media else 0
        handle.pruning.transfer_bytes = media_num_bytes + 2 * len(result.visual_entry_mask)
        return handle

    async def compile_structured_outputs(
        self,
        spec: StructuredOutputs,
        messages: Sequence[Message],
        media: MediaInput,
        request_id: str,
        cache_salt: str = "",
    ) -> None:
        message = prefill_pb2.CompileStructuredOutputsRequest(
            request_id=request_id, structured_outputs=convert.structured_to_proto(spec)
        )

        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> None:
            stub = prefill_pb2_grpc.PrefillServiceStub(channel)
            await stub.CompileStructuredOutputs(message, timeout=timeout_s)

        # `prefill`'s key, with the sha256 of the media the encoder has not answered yet (hashed
        # here as the encoder's routing hashes it): the replica whose compiler cache the prefill
        # then finds it in, unless that replica is lost or overloaded by then (it compiles again
        # where it goes, as without this call).
        key = prefill_key(messages, await media_key(media, self.pool), cache_salt)
        try:
            await self.pool.call(key, attempt, "prefill", request_id, self.timeout_s)
        except UpstreamError as exc:
            if exc.code in CONSTRAINT_REFUSALS:
                raise
            log.warning(
                "request %s: its structured output could not be compiled ahead (%s); prefill compiles it",
                request_id,
                exc,
            )

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        if not handle.kv_address:
            return
        request = prefill_pb2.ReleaseKvRequest(kv_handle=handle.kv_handle, request_id=request_id)
        async with self.kv_channels.use(handle.kv_address) as channel:
            try:
                await prefill_pb2_grpc.PrefillServiceStub(channel).ReleaseKv(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise stage_error(exc, "prefill", request_id) from None

    @property
    def known_model_info(self) -> ModelInfo | None:
        """What the replicas' model takes, as the gateway's background reads found it
        (`epd.gateway.model_info`); None until a replica answered."""
        return self._known_model_info

    @known_model_info.setter
    def known_model_info(self, info: ModelInfo | None) -> None:
        self._known_model_info = info
        if info is not None:
            self._model_info_known.set()  # wakes the requests that wait for it

    def model_info(self) -> ModelInfo | None:
        return self.known_model_info

    async def wait_model_info(self, timeout_s: float) -> ModelInfo | None:
        """The background reads poll every 0.25 s until a replica answers; when none has within
        `timeout_s`, one call of its own, through the pool as any stage call: its answer, or the
        stage's error, which says why (a gateway without the stages' internal secret is told so,
        a replica that is down is UNAVAILABLE), where the background reads only log at DEBUG."""
        if self._known_model_info is None:
            try:
                await within(self._model_info_known.wait(), timeout_s)
            except asyncio.TimeoutError:
                request_id = current_request_id()  # the waiting request's, when its door set it
                return await self.pool.call("", fetch_model_info, "prefill", request_id, self.timeout_s)
        return self._known_model_info

    async def tokenize(self, request: TokenizeInput, request_id: str) -> TokenizeOutput:
        message = tokenize_request_to_proto(request, request_id)

        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> prefill_pb2.TokenizeResult:
            return await prefill_pb2_grpc.PrefillServiceStub(channel).Tokenize(message, timeout=timeout_s)

        result = await self.pool.call("", attempt, "prefill", request_id, self.timeout_s)
        return tokenize_output_from_proto(result, request.return_token_strs)

    async def detokenize(self, token_ids: Sequence[int], request_id: str) -> str:
        message = prefill_pb2.DetokenizeRequest(request_id=request_id, token_ids=token_ids)

        async def attempt(channel: grpc.aio.Channel, timeout_s: float) -> prefill_pb2.DetokenizeResult:
            return await prefill_pb2_grpc.PrefillServiceStub(channel).Detokenize(message, timeout=timeout_s)

        return (await self.pool.call("", attempt, "prefill", request_id, self.timeout_s)).text

    async def close(self) -> None:
        """Close the pool's channels and the KV release channels (idempotent); the stage takes no
        call after it. The pool's were left open: they reconnected to stopped replicas until exit."""
        await self.pool.close()
        await self.kv_channels.close()
