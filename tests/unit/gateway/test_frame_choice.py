"""Which frames a request gets when it names fps, num_frames or neither, over a gateway whose own
default is a frame count (--num-frames 8): through the real HTTP and gRPC doors (in-process
servers, real sockets) up to the pipeline, which records the request. A request's fps was
overridden by the server's --num-frames, and a request naming both got num_frames silently."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from aiohttp import web

from epd.client import AsyncEpdClient, EpdError
from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.server import start
from epd.stages.errors import InvalidRequest
from epd.stages.server_config import ServerConfig
from epd.transport import convert
from epd.video.types import SamplingOptions

SERVER_DEFAULTS = SamplingOptions(fps=2.0, num_frames=8)
"""A gateway started with --num-frames 8 (and the default --fps)."""
ASKED = {
    "nothing": {},
    "fps": {"fps": 0.5},
    "num_frames": {"num_frames": 4},
    "both": {"fps": 0.5, "num_frames": 4},
}
EXPECTED = {
    "nothing": SERVER_DEFAULTS,
    "fps": SamplingOptions(fps=0.5, num_frames=None),  # the request's rate, not the server's count
    "num_frames": SamplingOptions(fps=2.0, num_frames=4),
}
REFUSAL = (
    "send num_frames (exactly that many frames) or fps (frames per second, at most max_frames), not both"
)


class _Recorded(InvalidRequest):
    """Ends the call once the pipeline has the request."""


class _RecordingPipeline(Pipeline):
    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # never reached
        self.sampling: list[SamplingOptions] = []

    async def ask(self, req):  # type: ignore[override]
        self.sampling.append(req.sampling)
        raise _Recorded("recorded")
        yield


def _http(media: dict) -> tuple[SamplingOptions | None, str]:
    async def run():
        pipeline = _RecordingPipeline()
        config = GatewayConfig(http=HttpApiConfig(port=0), sampling=SERVER_DEFAULTS)
        runner = web.AppRunner(HttpApi(config, pipeline, GatewayMetrics()).app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        body = {
            "media": media,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                        {"type": "text", "text": "q"},
                    ],
                }
            ],
        }
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                async with session.post("/v1/chat/completions", json=body) as resp:
                    message = json.loads(await resp.read())["error"]["message"]
        finally:
            await runner.cleanup()
        return (pipeline.sampling or [None])[0], message

    return asyncio.run(run())


def _grpc(options: dict) -> tuple[SamplingOptions | None, EpdError]:
    async def run():
        pipeline = _RecordingPipeline()
        config = GatewayConfig(server=ServerConfig(host="127.0.0.1", port=0), sampling=SERVER_DEFAULTS)
        hs = await start(config, pipeline)
        await hs.set_serving()
        try:
            async with AsyncEpdClient(f"127.0.0.1:{hs.port}", timeout_s=20) as client:
                with pytest.raises(EpdError) as info:
                    await client.ask(b"AAAA", "q", **options)
        finally:
            await hs.server.stop(None)
        return (pipeline.sampling or [None])[0], info.value

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize("asked", sorted(EXPECTED))
def test_the_requests_choice_wins_over_the_servers_default(asked):
    sampling, message = _http(ASKED[asked])
    assert sampling == EXPECTED[asked] and message.startswith("recorded")
    sampling, error = _grpc(ASKED[asked])
    assert sampling == EXPECTED[asked] and error.message.startswith("recorded")
    # On to the encoder (whose own defaults may hold another count): the gateway's choice stays.
    assert (
        convert.sampling_from_proto(convert.sampling_to_proto(EXPECTED[asked]), SERVER_DEFAULTS)
        == EXPECTED[asked]
    )


def test_fps_with_num_frames_is_refused_at_every_door():
    sampling, message = _http(ASKED["both"])
    assert sampling is None and message.startswith(f"'media': fps and num_frames: {REFUSAL}")
    sampling, error = _grpc(ASKED["both"])
    assert sampling is None and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message.startswith(f"fps 0.5 and num_frames 4: {REFUSAL}")
