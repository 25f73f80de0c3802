"""The gRPC front door's upload, like the HTTP API's body, must arrive whole within
--body-timeout: a client that sent its header and then trickled or stopped held its bytes of the
body budget and its request slot for as long as it liked. Real grpc.aio gateway server in this
process; the pipeline is never reached."""

from __future__ import annotations

import asyncio

import grpc

from epd.gateway.config import GatewayConfig
from epd.gateway.pipeline import Pipeline
from epd.gateway.server import start
from epd.stages.server_config import ServerConfig
from epd.v1 import gateway_pb2, gateway_pb2_grpc


def test_an_upload_that_stops_coming_is_deadline_exceeded_and_frees_its_slot_and_bytes():
    async def scenario():
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0), body_timeout_s=0.5)
        hs = await start(config, Pipeline(None, None, None))  # type: ignore[arg-type]
        await hs.set_serving()
        admission = hs.cut_calls.__self__.admission  # type: ignore[union-attr]
        held = asyncio.Event()

        async def stalls():
            header = gateway_pb2.AskHeader(question="what happens?", media_num_bytes=2048)
            yield gateway_pb2.AskRequest(header=header)
            yield gateway_pb2.AskRequest(media_chunk=b"v" * 1024)
            held.set()
            await asyncio.sleep(30)  # the rest never comes

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Ask(stalls())
                await held.wait()
                await asyncio.sleep(0.1)
                holding = (admission.num_requests, admission.num_reserved_bytes)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as exc:
                    error = (exc.code(), exc.details())
                else:
                    error = (None, "the call ended without an error")
                call.cancel()
            return holding, error, (admission.num_requests, admission.num_reserved_bytes)
        finally:
            await hs.server.stop(None)

    holding, (code, details), after = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert holding == (1, 1024)  # what the stalled upload held
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert details.startswith("the upload did not arrive within 0.5 s (the server's --body-timeout)"), details
    assert after == (0, 0)
