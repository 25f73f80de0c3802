"""Pulling a KV cache from a prefill server, only from addresses the operator allowed.

Pull, not push: the decoder asks for a cache once it has admitted the request, so a busy
decoder never receives bytes it cannot hold, and a decoder that fails simply never pulls (the
prefill side drops the cache at its TTL). The gateway never touches KV bytes.
"""

from __future__ import annotations

import fnmatch

import grpc

from model_runtime.kv_cache import KvCache
from protos.epd.v1 import prefill_pb2, prefill_pb2_grpc
from transport.errors import InvalidRequest
from transport.server import channel_options
from transport.tensor_wire import TensorAssembler


class KvPuller:
    def __init__(self, allowed_sources: tuple[str, ...], max_transfer_bytes: int, timeout_s: float) -> None:
        self.allowed_sources = allowed_sources
        self.max_transfer_bytes = max_transfer_bytes
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    def check_allowed(self, address: str) -> None:
        if not any(fnmatch.fnmatchcase(address, pattern) for pattern in self.allowed_sources):
            raise InvalidRequest(
                f"KV source {address!r} is not in this decoder's allowed list; the operator sets it "
                "with --allow-kv-from"
            )

    async def pull(self, address: str, handle: str) -> KvCache:
        self.check_allowed(address)
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=channel_options())
            self._channels[address] = channel
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        asm = TensorAssembler(self.max_transfer_bytes)
        async for msg in stub.PullKv(prefill_pb2.PullKvRequest(kv_handle=handle), timeout=self.timeout_s):
            asm.add(msg.tensor)
        return KvCache.from_named_tensors(asm.tensors())

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
