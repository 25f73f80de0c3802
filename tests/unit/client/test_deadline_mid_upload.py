"""A deadline that passes while the SDK is still sending the media is DEADLINE_EXCEEDED, not
INTERNAL. grpc.aio raises INTERNAL "Internal error from Core" itself when a request stream's
write is cut short by the call's end; a soak of the stack saw it for 2 of ~1,000 short-deadline
calls, and a 1 ms deadline on a 2 MB upload to a server that does not read gets it for most calls.
The server here is a bare GatewayService that never reads: what is under test is the SDK's
mapping, which must not depend on how fast a server answers."""

from __future__ import annotations

import asyncio
import collections

import grpc

from epd.client import AsyncEpdClient, EpdError
from epd.client.retry import RetryPolicy
from epd.v1 import gateway_pb2_grpc

NUM_CALLS = 20
MEDIA = b"x" * 2_000_000  # two chunks and more than the connection's flow-control window


class NeverReads(gateway_pb2_grpc.GatewayServiceServicer):
    async def Ask(self, request_iterator, context):  # noqa: N802 - gRPC's name
        await asyncio.sleep(60)
        yield  # an async generator, as the real servicer's streamed answer


def test_a_deadline_that_passes_mid_upload_is_deadline_exceeded():
    async def run() -> collections.Counter:
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(NeverReads(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        codes: collections.Counter = collections.Counter()
        try:
            async with AsyncEpdClient(f"127.0.0.1:{port}", retry=RetryPolicy(max_attempts=1)) as client:
                for _ in range(NUM_CALLS):
                    try:
                        await client.ask(MEDIA, "what happens?", timeout_s=0.001)
                    except EpdError as exc:
                        codes[exc.code] += 1
        finally:
            await server.stop(0)
        return codes

    assert asyncio.run(run()) == {grpc.StatusCode.DEADLINE_EXCEEDED: NUM_CALLS}
