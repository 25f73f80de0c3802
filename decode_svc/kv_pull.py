"""Pulling a KV cache from a prefill server, only from addresses the operator allowed.

Pull, not push: the decoder asks for a cache once it has admitted the request, so a busy
decoder never receives bytes it cannot hold, and a decoder that fails simply never pulls (the
gateway releases the cache, or the prefill side drops it at its TTL). The gateway never touches
KV bytes.

Then confirm: the pull asks prefill to keep the cache (`keep_until_confirmed`), and the decoder
confirms (`ReleaseKv` with `received`, which drops it there) only once the request's first token
has gone out (`epd.decode_svc.stage`): until then the gateway may still retry the request on
another decoder, which must find the cache. So a pull that breaks half way, or a decoder that
dies between its pull and its first token, leaves the cache at prefill for that retry; after the
first token nothing retries, and the copy goes. A decoder that dies in between leaks nothing for
longer than the TTL (and the gateway's release on the request's way out drops it sooner). A
confirmation that fails is logged and left to the TTL: this decoder has the cache, the request
goes on.

The address comes from the request, so it is parsed and checked against `--allow-kv-from`
(`decode_svc/kv_sources.py`), and the channel is opened to the target built from the parsed
host and port, never to the text as sent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from epd.decode_svc.kv_sources import KvSource, parse_allow_list, parse_source
from epd.model_runtime.kv_cache import KvCache
from epd.stages.contracts import PrefillHandle
from epd.stages.errors import InvalidRequest, KvSourceLost
from epd.stages.request_id import current_request_id
from epd.transport.channel_cache import ChannelCache
from epd.transport.errors import replica_lost
from epd.transport.server import traced_channel
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


def source_lost(exc: grpc.aio.AioRpcError) -> bool:
    """The pull failed because its prefill server is gone (stopped, killed, unreachable), not
    because of the request: gRPC's own UNAVAILABLE, or INTERNAL "Internal error from Core" (a
    connection cut mid-stream), or a hang past the pull's timeout."""
    return replica_lost(exc) or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED


MAX_IDLE_CHANNELS = 64
"""Channels to prefill servers kept open with no call on them (`ChannelCache`)."""


class KvPuller:
    def __init__(self, allowed_sources: tuple[str, ...], max_transfer_bytes: int, timeout_s: float) -> None:
        self.allowed_sources = allowed_sources
        self.allowed = parse_allow_list(allowed_sources)  # ValueError names the bad entry
        self.max_transfer_bytes = max_transfer_bytes
        self.timeout_s = timeout_s
        # By gRPC target. The request id goes with the pull and the confirmation.
        self.channels = ChannelCache(traced_channel, MAX_IDLE_CHANNELS)

    def check_allowed(self, address: str) -> KvSource:
        """The parsed source, if the allow-list admits it; InvalidRequest otherwise."""
        try:
            source = parse_source(address)
        except ValueError as exc:
            # The reason only: the client's text is not echoed back.
            raise InvalidRequest(f"the KV source address is not one HOST:PORT ({exc})") from None
        if not any(entry.admits(source) for entry in self.allowed):
            raise InvalidRequest(
                "the KV source address is not in this decoder's allowed list; the operator sets it "
                "with --allow-kv-from"
            )
        return source

    @asynccontextmanager
    async def _stub(self, address: str) -> AsyncIterator[prefill_pb2_grpc.PrefillServiceStub]:
        """A stub on the channel to `address` (checked), for one call."""
        async with self.channels.use(self.check_allowed(address).grpc_target) as channel:
            yield prefill_pb2_grpc.PrefillServiceStub(channel)

    async def pull(self, address: str, handle: str) -> KvCache:
        """The cache, whole; prefill keeps its copy until `confirm`."""
        asm = TensorAssembler(self.max_transfer_bytes)
        request = prefill_pb2.PullKvRequest(kv_handle=handle, keep_until_confirmed=True)
        try:
            async with self._stub(address) as stub:
                call = stub.PullKv(request, timeout=self.timeout_s)
                try:
                    async for msg in call:
                        asm.add(msg.tensor)
                finally:
                    # No-op once the call ended. A pull cancelled just as the call's start-up
                    # completes leaves it running (grpc.aio awaits that start outside its cancel
                    # handler): prefill would stream the cache to nobody until the deadline.
                    call.cancel()
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND too: a prefill replica restarted on the same address has an empty store.
            if not (source_lost(exc) or exc.code() == grpc.StatusCode.NOT_FOUND):
                raise
            # Not this decoder's failure: an UNAVAILABLE from here would make the gateway retry on
            # (and hold back) other decoders, which cannot reach the cache either.
            log.warning(
                "KV cache %s: not at its prefill server %s any more (%s %s)",
                handle,
                address,
                exc.code().name,
                exc.details(),
            )
            raise KvSourceLost(
                "the request's KV cache is no longer at the prefill replica that made it (the replica "
                "failed or restarted, or the cache expired) and the decoder does not have it; the "
                "request must be prefilled again"
            ) from None
        return KvCache.from_named_tensors(asm.tensors())

    async def confirm(self, address: str, handle: str) -> None:
        """Tell prefill this decoder no longer needs its copy of `handle`, which it drops."""
        request_id = current_request_id()
        try:
            async with self._stub(address) as stub:
                answer = await stub.ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(kv_handle=handle, request_id=request_id, received=True),
                    timeout=self.timeout_s,
                )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "could not confirm receipt of KV cache %s (%s %s): prefill drops it at its TTL",
                handle,
                exc.code().name,
                exc.details(),
            )
            return
        if not answer.released:  # the gateway released it meanwhile, or the TTL came first
            log.info("KV cache %s was gone at prefill by the time its receipt was confirmed", handle)

    async def take_kv(self, handle: PrefillHandle) -> KvCache:
        """The decode service's `TakeKv` (`epd.decode_svc.stage`): pull the cache from the prefill
        server that advertised it."""
        return await self.pull(handle.kv_address, handle.kv_handle)

    async def confirm_kv(self, handle: PrefillHandle) -> None:
        """The decode service's `ConfirmKv`: the request's first token has gone out."""
        await self.confirm(handle.kv_address, handle.kv_handle)

    async def close(self) -> None:
        await self.channels.close()
