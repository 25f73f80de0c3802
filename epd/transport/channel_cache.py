"""Channels to addresses that come and go with requests, kept open for reuse but bounded.

A KV cache's address comes from prefill's answer (the pod that holds it): decode pulls from it
(`epd.decode_svc.kv_pull`) and the gateway releases at it (`RemotePrefillStage.release`). Pods
are replaced and an allow-list such as `127.0.0.1:*` admits many ports, so a channel kept for
every address ever named (~20 KB each) grew without bound. Here at most `max_idle` channels with
no call on them stay open, the most recently used; a channel with a call in flight is never
closed under it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc

MAX_IDLE_CHANNELS = 64
"""Channels kept open with no call on them (each ~20 KB), by default."""


class ChannelCache:
    def __init__(
        self, open_channel: Callable[[str], grpc.aio.Channel], max_idle: int = MAX_IDLE_CHANNELS
    ) -> None:
        self.open_channel = open_channel
        self.max_idle = max_idle
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()  # least recently used first
        self._calls: Counter[str] = Counter()  # calls in flight on each target's channel

    @property
    def targets(self) -> list[str]:
        """The targets with an open channel, least recently used first."""
        return list(self._channels)

    @asynccontextmanager
    async def use(self, target: str) -> AsyncIterator[grpc.aio.Channel]:
        """The channel to `target` (opened if none is), for one call; idle channels beyond
        `max_idle` are closed first."""
        channel = self._channels.pop(target, None)
        if channel is None:
            channel = self.open_channel(target)
        self._channels[target] = channel
        self._calls[target] += 1
        try:
            await self._close_idle()
            yield channel
        finally:
            self._calls[target] -= 1
            if not self._calls[target]:
                del self._calls[target]

    async def _close_idle(self) -> None:
        while len(idle := [target for target in self._channels if not self._calls[target]]) > self.max_idle:
            # Out of the map before the await: a call meanwhile opens a new channel, never this one.
            await self._channels.pop(idle[0]).close()

    async def close(self) -> None:
        while self._channels:
            await self._channels.popitem(last=False)[1].close()
