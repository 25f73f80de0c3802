"""The server factory: a port already in use is an error, not a silently shared socket."""

import asyncio

import pytest

from epd.stages.server_config import ServerConfig
from epd.transport.server import create_server


def test_second_server_on_a_used_port_fails():
    async def run():
        first = await create_server(ServerConfig(port=0), lambda s: None, [])
        try:
            with pytest.raises(OSError, match="already using that port"):
                await create_server(ServerConfig(port=first.port), lambda s: None, [])
        finally:
            await first.stop(0)

    asyncio.run(run())
