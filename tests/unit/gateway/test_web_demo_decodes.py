"""The web demo's decodes (`POST /demo/frames`) through real HTTP on loopback, on an in-process
gateway with handler cancellation as it is served: a client that disconnects mid-decode keeps its
admission slot until the decode has stopped, the decode sees its cancel flag, it runs on the
demo's own bounded threads (so asyncio's default executor stays free for the rest of the
gateway), a full demo answers 429 + Retry-After, and the operator's decode limits apply.

The decode is a stand-in held by the test (`HeldDecode`) where the test needs to control when it
ends; the limits test runs the real decoder."""

from __future__ import annotations

import asyncio
import base64
import threading

import aiohttp
import pytest
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig, WebDemoConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.gateway.web import routes
from epd.gateway.web.demo_decodes import THREAD_NAME_PREFIX
from epd.transport import tracing
from epd.video.types import DecodeCancelled, DecodeLimits
from tests.log_records import log_records
from tests.media import make_video

WAIT_S = 30.0
"""Bound on waits for the other side (never reached unless the test fails)."""
BODY = {
    "video_url": "data:video/mp4;base64," + base64.b64encode(b"\x00" * 64).decode(),
    "media": {"num_frames": 2},
}


class HeldDecode:
    """Stands in for `sampled_thumbnails`: records each call's thread, waits for its cancel flag
    (or `let_go`), then returns thumbnails, or raises DecodeCancelled when it was cancelled."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.saw_cancel = threading.Event()
        self.let_go = threading.Event()
        self.thread_names: list[str] = []

    def __call__(self, data, sampling, limits, cancel=None):
        cancel = cancel or threading.Event()  # (a caller that passes none never cancels)
        self.limits = limits
        self.thread_names.append(threading.current_thread().name)
        self.started.set()
        for _ in range(int(WAIT_S / 0.01)):  # bounded, so that a failing test still ends
            if cancel.is_set() or self.let_go.is_set():
                break
            cancel.wait(0.01)
        if cancel.is_set():
            self.saw_cancel.set()
            self.let_go.wait(WAIT_S)  # a decode that takes a while to notice: the slot stays taken
            raise DecodeCancelled("cancelled")
        return {"frames": [], "width": 1, "height": 1, "is_image": False}


async def _serve(fn, demo: WebDemoConfig, max_requests_per_client: int = 8):
    config = GatewayConfig(
        max_requests_per_client=max_requests_per_client, http=HttpApiConfig(port=0, demo=demo)
    )
    api = HttpApi(config, Pipeline(None, None, None), GatewayMetrics())  # type: ignore[arg-type]
    runner = web.AppRunner(api.app(), handler_cancellation=True)  # as start_http_api serves it
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        return await fn(f"http://127.0.0.1:{runner.addresses[0][1]}/demo/frames", api.admission)
    finally:
        await runner.cleanup()


@pytest.fixture
def held(monkeypatch) -> HeldDecode:
    decode = HeldDecode()
    monkeypatch.setattr(routes, "sampled_thumbnails", decode)
    return decode


async def _post(session: aiohttp.ClientSession, url: str) -> tuple[int, str | None, str]:
    """(status, Retry-After, error message or "") of one demo request."""
    async with session.post(url, json=BODY) as resp:
        body = await resp.json()
        return resp.status, resp.headers.get("Retry-After"), body.get("error", {}).get("message", "")


async def _wait_for(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, WAIT_S)


async def _until(condition) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_a_client_that_disconnects_keeps_its_slot_until_the_decode_has_stopped(held):
    async def calls(url, admission):
        async with aiohttp.ClientSession() as leaving:
            first = asyncio.ensure_future(leaving.post(url, json=BODY))
            assert await _wait_for(held.started)
            first.cancel()  # the client gives up: its connection closes mid-request
        assert await _wait_for(held.saw_cancel), "the decode never saw its cancel flag"
        async with aiohttp.ClientSession() as session:
            refused = await _post(session, url)  # its decode still runs: no slot
            in_flight = admission.num_requests, admission.num_reserved_bytes
            held.let_go.set()  # the decode stops
            await _until(lambda: admission.num_requests == 0)
            after = await _post(session, url)
            return refused, in_flight, after[0], admission.num_reserved_bytes

    refused, in_flight, after, bytes_after = asyncio.run(
        _serve(calls, WebDemoConfig(), max_requests_per_client=1)
    )
    assert refused[:2] == (429, "1") and "--max-requests-per-client" in refused[2]
    assert in_flight[0] == 1 and in_flight[1] > 0  # its slot and its body's bytes, still reserved
    assert after == 200 and bytes_after == 0
    assert all(name.startswith(THREAD_NAME_PREFIX) for name in held.thread_names)


def test_a_full_demo_refuses_with_retry_after_and_leaves_the_default_executor_free(held):
    async def calls(url, admission):
        async with aiohttp.ClientSession() as session:
            first = asyncio.ensure_future(session.post(url, json=BODY))
            assert await _wait_for(held.started)
            refused = await _post(session, url)
            # Many more to_thread calls than the demo has threads: none waits behind the decode.
            done = await asyncio.gather(*(asyncio.to_thread(lambda: True) for _ in range(64)))
            held.let_go.set()
            async with await first as answer:
                return refused, all(done), answer.status, (await answer.json())["width"]

    refused, others_ran, status, width = asyncio.run(_serve(calls, WebDemoConfig(max_concurrent_decodes=1)))
    assert refused[:2] == (429, "1") and "--demo-max-concurrent-decodes" in refused[2]
    assert others_ran and status == 200 and width == 1
    assert held.thread_names == [f"{THREAD_NAME_PREFIX}_0"]


@pytest.mark.parametrize("limit,message", [
    ({"max_duration_s": 1.0}, "--max-duration-s"),
    ({"max_source_pixels": 100 * 100}, "--max-source-pixels"),
])  # fmt: skip
def test_the_operators_decode_limits_apply_to_the_demo(tmp_path, limit, message):
    """The demo used `DecodeLimits()` whatever the operator set: a 3 s, 320x240 clip passed
    limits that the encoder refuses it with."""
    data = make_video(
        tmp_path / "clip.mp4", codec="h264", size=(320, 240), fps=10.0, seconds=3.0, gop=10
    ).read_bytes()
    body = {
        "video_url": "data:video/mp4;base64," + base64.b64encode(data).decode(),
        "media": {"num_frames": 2},
    }

    async def calls(url, admission):
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body) as resp:
                return resp.status, (await resp.json())

    status, answer = asyncio.run(_serve(calls, WebDemoConfig(limits=DecodeLimits(**limit))))
    assert status == 413 and message in answer["error"]["message"]
    assert asyncio.run(_serve(calls, WebDemoConfig()))[0] == 200


def test_a_demo_decodes_log_lines_carry_the_request_id(tmp_path):
    """The demo's threads ran the decoder outside the request's context: "video decode failed"
    went to the log without the request id that the client's 400 names, so the operator could
    not find it (the encoder's decode drivers run in the request's context)."""
    data = bytearray(
        make_video(
            tmp_path / "clip.mp4", codec="h264", size=(64, 48), fps=10.0, seconds=2.0, gop=10
        ).read_bytes()
    )
    data[len(data) // 2 : len(data) // 2 + 500] = b"\x00" * 500  # corrupt frames: the decoder fails and logs
    body = {
        "video_url": "data:video/mp4;base64," + base64.b64encode(bytes(data)).decode(),
        "media": {"num_frames": 2},
    }

    async def calls(url, admission):
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url, json=body, headers={tracing.REQUEST_ID_KEY: "demo-decode-7"}
            ) as resp:
                return resp.status, (await resp.json())["error"]["message"]

    with log_records("epd.video.simple_decoder") as records:
        status, message = asyncio.run(_serve(calls, WebDemoConfig()))
    assert status == 400 and "(request id demo-decode-7)" in message
    failed = [r for r in records if "decode failed" in r.getMessage()]
    assert failed and all(r.request_id == "demo-decode-7" for r in failed)  # type: ignore[attr-defined]


def test_the_gateway_flags_set_the_demo_and_the_stack_passes_the_encoders_limits():
    from epd.cli import configs
    from epd.cli.parsers.root import build_parser
    from epd.cli.stack_commands import stack_commands

    args = build_parser().parse_args(
        [
            "serve",
            "gateway",
            "--max-duration-s",
            "30",
            "--max-source-pixels",
            "4096",
            "--demo-max-concurrent-decodes",
            "3",
        ]
    )
    demo = configs.gateway_config(args).http.demo
    assert demo.max_concurrent_decodes == 3
    assert (demo.limits.max_duration_s, demo.limits.max_source_pixels) == (30.0, 4096)
    stack = build_parser().parse_args(
        ["serve", "--max-duration-s", "30", "--max-decode-s", "7", "--demo-max-concurrent-decodes", "5"]
    )
    gateway = stack_commands(stack)["gateway"]
    assert gateway[gateway.index("--max-duration-s") + 1] == "30.0"
    assert gateway[gateway.index("--max-decode-s") + 1] == "7.0"
    assert gateway[gateway.index("--demo-max-concurrent-decodes") + 1] == "5"
    colocated = configs.colocated_gateway_config(
        build_parser().parse_args(
            ["serve", "--colocate", "--max-duration-s", "30", "--demo-max-concurrent-decodes", "4"]
        )
    )
    assert colocated.http.demo.limits.max_duration_s == 30.0
    assert colocated.http.demo.max_concurrent_decodes == 4
