"""Pulling a KV cache from a prefill server, only from addresses the operator allowed.

Pull, not push: the decoder asks for a cache once it has admitted the request, so a busy
decoder never receives bytes it cannot hold, and a decoder that fails simply never pulls (the
prefill side drops the cache at its TTL). The gateway never touches KV bytes.

The address comes from the request, so it is parsed and checked against `--allow-kv-from`
(`decode_svc/kv_sources.py`), and the channel is opened to the target built from the parsed
host and port, never to the text as sent.
"""

from __future__ import annotations

import grpc

from epd.decode_svc.kv_sources import KvSource, parse_allow_list, parse_source
from epd.model_runtime.kv_cache import KvCache
from epd.stages.contracts import PrefillHandle
from epd.stages.errors import InvalidRequest
from epd.transport.server import channel_options
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import prefill_pb2, prefill_pb2_grpc


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
        target = self.check_allowed(address).grpc_target
        channel = self._channels.get(target)
        if channel is None:
            channel = grpc.aio.insecure_channel(target, options=channel_options())
            self._channels[target] = channel
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        asm = TensorAssembler(self.max_transfer_bytes)
        async for msg in stub.PullKv(prefill_pb2.PullKvRequest(kv_handle=handle), timeout=self.timeout_s):
            asm.add(msg.tensor)
        return KvCache.from_named_tensors(asm.tensors())

    async def take_kv(self, handle: PrefillHandle) -> KvCache:
        """The decode service's `TakeKv` (`epd.decode_svc.stage`): pull the cache from the prefill
        server that advertised it."""
        return await self.pull(handle.kv_address, handle.kv_handle)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
