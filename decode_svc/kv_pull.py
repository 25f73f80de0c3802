"""Pulling a KV cache from a prefill server, only from addresses the operator allowed.

Pull, not push: the decoder asks for a cache once it has admitted the request, so a busy
decoder never receives bytes it cannot hold, and a decoder that fails simply never pulls (the
gateway releases the cache, or the prefill side drops it at its TTL). The gateway never touches
KV bytes.

Then confirm: the pull asks prefill to keep the cache (`keep_until_confirmed`), and only once all
of it is here and assembled does the decoder confirm receipt (`ReleaseKv` with `received`), which
drops it there. A pull that breaks half way (this decoder dies, the stream is cut, the call is
cancelled) leaves the cache at prefill, so the gateway's retry on another decoder can pull it
again; a decoder that dies after pulling and before confirming leaks nothing for longer than
the TTL (and the gateway's release on the request's way out drops it sooner). A confirmation that
fails is logged and left to the TTL: this decoder has the cache, the request goes on.

The address comes from the request, so it is parsed and checked against `--allow-kv-from`
(`decode_svc/kv_sources.py`), and the channel is opened to the target built from the parsed
host and port, never to the text as sent.
"""

from __future__ import annotations

import logging

import grpc

from epd.decode_svc.kv_sources import KvSource, parse_allow_list, parse_source
from epd.model_runtime.kv_cache import KvCache
from epd.stages.contracts import PrefillHandle
from epd.stages.errors import InvalidRequest
from epd.transport import tracing
from epd.transport.server import traced_channel
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class KvPuller:
    def __init__(self, allowed_sources: tuple[str, ...], max_transfer_bytes: int, timeout_s: float) -> None:
        self.allowed_sources = allowed_sources
        self.allowed = parse_allow_list(allowed_sources)  # ValueError names the bad entry
        self.max_transfer_bytes = max_transfer_bytes
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}  # by gRPC target

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

    async def pull(self, address: str, handle: str) -> KvCache:
        """The cache, whole; prefill keeps it until this returns (then it is confirmed)."""
        target = self.check_allowed(address).grpc_target
        channel = self._channels.get(target)
        if channel is None:
            channel = traced_channel(target)  # the request id goes with the pull and the confirmation
            self._channels[target] = channel
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        asm = TensorAssembler(self.max_transfer_bytes)
        request = prefill_pb2.PullKvRequest(kv_handle=handle, keep_until_confirmed=True)
        async for msg in stub.PullKv(request, timeout=self.timeout_s):
            asm.add(msg.tensor)
        cache = KvCache.from_named_tensors(asm.tensors())
        await self.confirm(stub, handle)
        return cache

    async def confirm(self, stub: prefill_pb2_grpc.PrefillServiceStub, handle: str) -> None:
        """Tell prefill this decoder holds the whole cache of `handle`, so it drops its copy."""
        request_id = tracing.current_request_id()
        try:
            answer = await stub.ReleaseKv(
                prefill_pb2.ReleaseKvRequest(kv_handle=handle, request_id=request_id, received=True),
                timeout=self.timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not confirm receipt of KV cache %s (%s %s): prefill drops it at its TTL",
                        handle, exc.code().name, exc.details())
            return
        if not answer.released:  # the gateway released it meanwhile, or the TTL came first
            log.info("KV cache %s was gone at prefill by the time its receipt was confirmed", handle)

    async def take_kv(self, handle: PrefillHandle) -> KvCache:
        """The decode service's `TakeKv` (`epd.decode_svc.stage`): pull the cache from the prefill
        server that advertised it."""
        return await self.pull(handle.kv_address, handle.kv_handle)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
