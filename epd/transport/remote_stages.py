"""Stages that call the gRPC services: the gateway's view of the disaggregated stack.

Each stage holds one channel per replica address (client-side load balancing; in Kubernetes the
addresses are the pods a headless Service's `dns:///` name resolves to, `epd.gateway.dns_replicas`,
or come from a replica file the gateway reloads, `epd.gateway.replica_list`). A call about media goes to the replica that rendezvous hashing of
the media's sha256 picks among the healthy ones, unless that replica is overloaded; a call without
media goes to the least loaded healthy replica (`epd.transport.affinity`).

Retries, before anything reached the client only. Encode and prefill are idempotent (a cache miss
on another replica, the same answer): a try that fails with UNAVAILABLE (replica gone, draining or
not reachable), or that hangs past `attempt_timeout_s`, is made again on the next healthy replica
in the call's order, each healthy replica at most once, while the call's deadline allows: the
stage timeout, or less when the request's client gives up sooner (its gRPC deadline,
`epd.stages.deadline`), which each stage gets with the call. A decode
stream that fails the same ways before its first token is retried the same way (the new replica
pulls the KV cache from prefill again; if that cache is gone the retry fails and says so). After
the first token nothing is retried: the client has part of an answer, and gets ABORTED saying so
(`epd.transport.errors.broken_stream`). Every other status is the request's own and passes on.

Tensors pass through in wire form (`epd.transport.tensor_wire.WireTensor`): the gateway relays the
encoder's embeddings to prefill and prefill's visual-entry mask to decode without torch.

Cancelling a stage call (the gateway's request task is cancelled when its client goes away)
cancels the RPC, and the service's handler is cancelled in turn. A KV cache is released at the
prefill replica that holds it, by the address that replica advertised (`kv_address`), since a
replica address may stand for several (a plain name gRPC balances over).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import grpc

from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
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
from epd.stages.deadline import timeout_within_client_deadline
from epd.stages.errors import InvalidRequest, KvSourceLost
from epd.stages.messages import ChatTemplateOptions, Message
from epd.stages.model_info import ModelInfo
from epd.stages.raw_prompt import RawPrompt
from epd.stages.server_config import CHUNK_BYTES
from epd.stages.tokenize import TokenizeInput, TokenizeOutput
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.affinity import (
    FAILURE_HOLD_S,
    MAX_EXCESS_LOAD,
    ReplicaChooser,
    prefill_key,
    raw_prompt_key,
)
from epd.transport.aio_cancel import cancelled_by_grpc, within
from epd.transport.channel_cache import ChannelCache
from epd.transport.errors import (
    UpstreamError,
    broken_stream,
    failed_after_retry,
    replica_lost,
    retry_after_of,
    stage_error,
)
from epd.transport.model_info import tokenize_output_from_proto, tokenize_request_to_proto
from epd.transport.server import RECONNECT_OPTIONS, channel_options, traced_channel
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

log = logging.getLogger(__name__)

T = TypeVar("T")

HASH_IN_THREAD_BYTES = 1 << 20
"""Uploads at least this large are hashed (for routing) off the event loop."""

FORMER_NAMES_MAX = 4096
"""Removed addresses whose TLS name a pool remembers (`ReplicaPool.server_name`): far more pods
than leave routing within a KV cache's lifetime (--kv-ttl)."""

CONSTRAINT_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""What prefill's CompileStructuredOutputs answers for the constraint itself (it does not compile;
too many slow compiles run: retry later), which refuses the request; any other status (a replica
lost, one that predates the call: UNIMPLEMENTED) leaves the compile to the request's Prefill."""

HANG_SLACK_S = 0.05
"""A try that ended in DEADLINE_EXCEEDED this close to its attempt timeout hung (ours expired);
one that ended sooner got the status from the service itself, which is the request's own."""


def unresolved(address: str) -> bool:
    """Whether a pool's entry is a `dns:///NAME:PORT` name the gateway has not found yet: it
    replaces a name by its addresses once a lookup finds them (`epd.gateway.dns_replicas`, whose
    DNS_PREFIX this is). Such an entry gets no call, no health check and no load read: dialled as
    written, gRPC's own resolver spread the calls over the pods behind it, past the router's
    affinity, load and failure hold, and a prefill pod reached that way advertised an IP the
    gateway could not check its certificate for (its KV cache was then not released). Nor does it
    get a channel (`ReplicaPool`): one would sit idle, never connecting, for as long as the name
    stayed unresolved (for good, for a name that never resolves)."""
    return address.startswith("dns:///")


class ReplicaPool:
    """Channels to the replicas of one stage and the order a call tries them in
    (`epd.transport.affinity.ReplicaChooser`: by a key, a media sha256 or a conversation's
    opening, else least loaded)."""

    def __init__(
        self,
        addresses: Sequence[str],
        failure_hold_s: float = FAILURE_HOLD_S,
        routing: str = "affinity",
        attempt_timeout_s: float = 0.0,
        max_excess_load: int = MAX_EXCESS_LOAD,
        server_names: Mapping[str, str] | None = None,
    ) -> None:
        self.chooser = ReplicaChooser(
            addresses, failure_hold_s, routing=routing, max_excess_load=max_excess_load
        )
        self.attempt_timeout_s = attempt_timeout_s
        """Longest one try may take before the next replica is tried (0: the whole deadline)."""
        self._server_names = dict(server_names or {})
        """address -> the name its TLS certificate is checked against, for an address the gateway
        resolved from a `dns:///NAME:PORT` entry (NAME; `epd.gateway.dns_replicas`)."""
        self._former_names: dict[str, str] = {}
        """The same for addresses no longer listed (oldest first, at most FORMER_NAMES_MAX): a
        prefill pod that left its Service's DNS answer (draining) may still hold KV caches, which
        the gateway releases at its address (`RemotePrefillStage.release`)."""
        self._by_address = {a: self._open(a) for a in self.chooser.replicas if not unresolved(a)}
        """A channel per address the pool routes over; none for a name not resolved yet."""
        self._retired: dict[str, grpc.aio.Channel] = {}  # removed replicas with calls still open
        self._closing: set[asyncio.Future] = set()

    def _open(self, address: str) -> grpc.aio.Channel:
        # round_robin: a target gRPC resolves itself (a plain `name:port`) spreads calls over every
        # address behind the name (gRPC's default pick_first would send all of them to one).
        options = [*channel_options(), *RECONNECT_OPTIONS, ("grpc.lb_policy_name", "round_robin")]
        return traced_channel(address, options, server_name=self._server_names.get(address, ""))

    @property
    def addresses(self) -> list[str]:
        return list(self.chooser.replicas)

    @property
    def channels(self) -> list[grpc.aio.Channel]:
        """The replicas' channels, in list order (a name not resolved yet has none)."""
        return [self._by_address[a] for a in self.chooser.replicas if a in self._by_address]

    def channel(self, address: str) -> grpc.aio.Channel:
        """The channel of a listed replica; KeyError for a name not resolved yet (`unresolved`)."""
        return self._by_address[address]

    def server_name(self, address: str) -> str:
        """The name `address`'s TLS certificate is checked against ("": the address itself); for an
        address listed before, the name it was listed under."""
        if address in self._server_names or address in self.chooser.replicas:
            return self._server_names.get(address, "")
        return self._former_names.get(address, "")

    def set_addresses(
        self, addresses: Sequence[str], server_names: Mapping[str, str] | None = None
    ) -> tuple[list[str], list[str]]:
        """Route over `addresses` from now on (a reloaded replica list, a name resolved again);
        returns (added, removed). A removed replica's channel closes once the calls open on it end.
        `server_names`: as in the constructor, for the addresses added."""
        added, removed = self.chooser.set_replicas(addresses)
        for a in removed:
            if name := self._server_names.get(a):
                self._former_names.pop(a, None)
                self._former_names[a] = name
        while len(self._former_names) > FORMER_NAMES_MAX:
            del self._former_names[next(iter(self._former_names))]
        self._server_names = dict(server_names or {})
        for a in added:
            if not unresolved(a):
                self._by_address[a] = self._retired.pop(a, None) or self._open(a)
        for a in removed:
            if a in self._by_address:  # a name not resolved yet had no channel
                self._retired[a] = self._by_address.pop(a)
        self._close_idle()
        return added, removed

    def _close_idle(self) -> None:
        for address in [a for a in self._retired if self.chooser.in_flight(a) == 0]:
            closing = asyncio.ensure_future(self._retired.pop(address).close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def begin(self, address: str) -> None:
        self.chooser.begin(address)

    def end(self, address: str) -> None:
        self.chooser.end(address)
        if address in self._retired:
            self._close_idle()

    def pick(self, key: str = "") -> grpc.aio.Channel:
        """The channel a call with affinity `key` ("" = none) goes to first: `candidates`' first
        (never a name not resolved yet; IndexError when the pool has nothing else)."""
        return self.candidates(key)[0][1]

    def candidates(self, key: str = "") -> list[tuple[str, grpc.aio.Channel]]:
        """(address, channel) of the replicas one call may try, best first: the healthy ones, or
        every replica when none is believed healthy (a stale belief costs a try, not the request).
        A name not resolved yet is none (`unresolved`): [] when the pool has nothing else."""
        order = [a for a in self.chooser.order(key) if not unresolved(a)]
        healthy = set(self.chooser.healthy())
        return [(a, self._by_address[a]) for a in ([a for a in order if a in healthy] or order)]

    def nothing_to_call(self, stage: str, request_id: str) -> UpstreamError:
        """The error of a call made while every entry of the pool is a name not resolved yet."""
        log.warning(
            "request %s: no %s replica to call: %s not resolved yet",
            request_id,
            stage,
            ", ".join(self.chooser.replicas),
        )
        return UpstreamError(
            grpc.StatusCode.UNAVAILABLE, f"{stage} stage unavailable (request id {request_id})"
        )

    def still_listed(
        self, tries: Sequence[tuple[str, grpc.aio.Channel]]
    ) -> list[tuple[str, grpc.aio.Channel]]:
        """Those of a call's `tries` still in the replica list, each with its current channel. A
        replica removed since the call began (a reloaded replica file) gets no retry: its channel
        closes once its last call ends, and a call made on a closed channel crashed the gateway
        (gRPC core aborted the process, SIGSEGV / SIGABRT)."""
        return [(a, self._by_address[a]) for a, _ in tries if a in self._by_address]

    def set_serving(self, address: str, serving: bool) -> None:
        """A health check's answer (the gateway's stage checks, epd/gateway/readiness.py)."""
        self.chooser.set_serving(address, serving)

    def mark_failed(self, address: str, hung: bool = False) -> None:
        self.chooser.mark_failed(address, hung)

    def try_timeout_s(self, remaining_s: float) -> float:
        """The timeout of one try with `remaining_s` left of the call's deadline."""
        if self.attempt_timeout_s > 0:
            return min(remaining_s, self.attempt_timeout_s)
        return remaining_s

    async def call(
        self,
        key: str,
        attempt: Callable[[grpc.aio.Channel, float], Awaitable[T]],
        stage: str,
        request_id: str,
        timeout_s: float,
    ) -> T:
        """`attempt(channel, try_timeout_s)` on the first choice for `key`; when a try fails with
        UNAVAILABLE or hangs past `attempt_timeout_s`, again on the next healthy replica (a fresh
        attempt: the caller rebuilds its request stream), each at most once, within `timeout_s`
        seconds in all, and within the time the request's client has left (`epd.stages.deadline`).
        Any other failure, or the last try's, is the stage's error."""
        loop = asyncio.get_running_loop()
        end_at = loop.time() + timeout_within_client_deadline(timeout_s)
        tries = self.candidates(key)
        if not tries:
            raise self.nothing_to_call(stage, request_id)
        while tries:
            (address, channel), tries = tries[0], self.still_listed(tries[1:])
            remaining = end_at - loop.time()
            try_timeout_s = self.try_timeout_s(remaining)
            started = loop.time()
            self.begin(address)
            try:
                answer = await attempt(channel, try_timeout_s)
                self.chooser.mark_answered(address)
                return answer
            except asyncio.CancelledError:
                if not cancelled_by_grpc():
                    raise  # the request's task was cancelled (its client went away)
                # grpc.aio cancelled the call itself: its request stream could not be written
                # (epd.transport.aio_cancel). A failure of this call, not a gone client.
                late = loop.time() - started >= try_timeout_s
                log.warning(
                    "request %s: gRPC cancelled the %s call to %s while sending its request%s",
                    request_id,
                    stage,
                    address,
                    " (past its deadline)" if late else "",
                )
                code = grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.INTERNAL
                what = (
                    "timed out before its request was sent"
                    if late
                    else "call failed while sending its request"
                )
                raise UpstreamError(code, f"{stage} stage {what} (request id {request_id})") from None
            except grpc.aio.AioRpcError as exc:
                hung = (
                    exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    and try_timeout_s < remaining
                    and loop.time() - started >= try_timeout_s - HANG_SLACK_S
                )
                if not replica_lost(exc) and not hung:
                    raise stage_error(exc, stage, request_id) from None
                self.mark_failed(address, hung)
                what = (
                    f"did not answer in {try_timeout_s:.1f} s" if hung else f"unavailable ({exc.details()})"
                )
                tries = self.still_listed(tries)  # the list may have changed during the try
                if not tries or end_at - loop.time() <= 0:
                    # One line (stage_error logs none): before the stages are ready every
                    # early request ends here, and two lines each buried the start-up's own.
                    if self.chooser.ready_once:
                        log.warning(
                            "%s replica %s %s for request %s; no replica left to try",
                            stage,
                            address,
                            what,
                            request_id,
                        )
                    else:
                        log.warning(
                            "request %s: the %s stage is not ready (no replica has served yet): %s %s",
                            request_id,
                            stage,
                            address,
                            what,
                        )
                    raise stage_error(exc, stage, request_id, logged=True) from None
                log.warning(
                    "%s replica %s %s for request %s; trying %s",
                    stage,
                    address,
                    what,
                    request_id,
                    tries[0][0],
                )
            finally:
                self.end(address)
        raise AssertionError("unreachable: a pool has at least one replica")

    async def close(self) -> None:
        """Close every channel of the pool, retired ones too; idempotent. The pool takes no call
        after it (a call made on a closed channel crashed the process, `still_listed`)."""
        for ch in [*self._by_address.values(), *self._retired.values()]:
            await ch.close()  # a closed grpc.aio channel's close() returns at once
        self._retired.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


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
        self.known_model_info: ModelInfo | None = None
        """What the replicas' model takes, as the gateway's background reads found it
        (`epd.gateway.model_info`); None until a replica answered."""

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

    def model_info(self) -> ModelInfo | None:
        return self.known_model_info

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


class RemoteDecodeStage(DecodeStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    async def close(self) -> None:
        """Close the pool's channels (idempotent); the stage takes no call after it."""
        await self.pool.close()

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        """Tokens from the least loaded decode replica. One that fails (UNAVAILABLE) or hangs past
        the pool's attempt timeout before its first token is left for the next healthy replica,
        each at most once within `timeout_s` and the time the request's client has left
        (`epd.stages.deadline`); after the first token a failure is ABORTED. One that
        is full (RESOURCE_EXHAUSTED marked busy) is left for the next replica too; when the last
        is full as well, that busy error is raised (the pipeline waits for room)."""
        if not handle.kv_address:
            raise InvalidRequest("a remote decoder needs the prefill server's kv_address")
        request = decode_pb2.GenerateRequest(
            request_id=request_id,
            prefill=convert.handle_to_proto(handle),
            generation=convert.generation_to_proto(generation),
            pruning=convert.pruning_to_proto(pruning),
        )
        end_at = time.monotonic() + timeout_within_client_deadline(self.timeout_s)
        tries = self.pool.candidates()
        if not tries:
            raise self.pool.nothing_to_call("decode", request_id)
        failed: list[str] = []  # "ADDRESS: what happened", for the log and the last error
        while tries:
            (address, channel), tries = tries[0], self.pool.still_listed(tries[1:])
            remaining = end_at - time.monotonic()
            first_timeout_s = self.pool.try_timeout_s(remaining)
            call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=remaining)
            num_tokens = 0
            self.pool.begin(address)
            try:
                stream = call.__aiter__()
                try:
                    first = await within(stream.__anext__(), first_timeout_s)  # keeps a cancel
                except asyncio.TimeoutError:
                    if first_timeout_s >= remaining:  # the call's own deadline, not a hang
                        raise UpstreamError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"decode stage did not answer in time (request id {request_id})",
                        ) from None
                    self.pool.mark_failed(address, hung=True)
                    failed.append(f"{address}: no first token in {first_timeout_s:.1f} s")
                    tries = self.pool.still_listed(tries)  # the list may have changed during the try
                    if not tries:
                        raise UpstreamError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"decode stage did not answer in time (request id {request_id})",
                        ) from None
                    log.warning(
                        "decode replica %s gave no first token in %.1f s for request %s; trying %s",
                        address,
                        first_timeout_s,
                        request_id,
                        tries[0][0],
                    )
                    continue
                except StopAsyncIteration:
                    return
                step = convert.token_step_from_proto(first)
                num_tokens += len(step.token_ids)
                yield step
                async for msg in stream:
                    step = convert.token_step_from_proto(msg)
                    num_tokens += len(step.token_ids)
                    yield step
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if num_tokens or not replica_lost(exc):
                    if num_tokens and code in BROKEN_STREAM_CODES:
                        log.warning(
                            "request %s: decode replica %s failed after %d tokens: %s %s",
                            request_id,
                            address,
                            num_tokens,
                            code.name,
                            exc.details(),
                        )
                        raise broken_stream("decode", num_tokens, request_id) from None
                    if not num_tokens and code == grpc.StatusCode.ABORTED:  # its prefill replica is gone
                        raise KvSourceLost(exc.details() or "the request's KV cache was lost") from None
                    tries = self.pool.still_listed(tries)
                    if not num_tokens and retry_after_of(exc) is not None and tries:
                        # Full (`Busy`, its KV memory and wait queue): it took nothing, pulled no
                        # cache and stays healthy; a sibling may have room.
                        log.info(
                            "decode replica %s is full for request %s; trying %s",
                            address,
                            request_id,
                            tries[0][0],
                        )
                        continue
                    if failed:
                        log.warning(
                            "request %s: decode retried after %s; then %s: %s %s",
                            request_id,
                            "; ".join(failed),
                            address,
                            code.name,
                            exc.details(),
                        )
                        raise failed_after_retry(stage_error(exc, "decode", request_id), "decode") from None
                    raise stage_error(exc, "decode", request_id) from None
                self.pool.mark_failed(address)
                failed.append(f"{address}: unavailable ({exc.details()})")
                tries = self.pool.still_listed(tries)
                if not tries or end_at - time.monotonic() <= 0:
                    raise stage_error(exc, "decode", request_id) from None
                log.warning(
                    "decode replica %s unavailable before the first token of request %s (%s); trying %s",
                    address,
                    request_id,
                    exc.details(),
                    tries[0][0],
                )
            finally:
                call.cancel()  # no-op once it ended; stops the replica when the consumer went away
                self.pool.end(address)


BROKEN_STREAM_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.CANCELLED,
    }
)
"""How a decode replica that died (or was stopped) mid-answer ends its stream; after the first token
these become ABORTED (`broken_stream`): the answer is incomplete and only the whole request can be
retried. Other codes (the deadline, the request's own errors) pass on as they are."""
