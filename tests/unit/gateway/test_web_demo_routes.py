"""The web demo's endpoints on an in-process HTTP server (real sockets, real PyAV video): the
page and its files, the bundled samples, and the sampled-frame thumbnails with the encoder's
frame selection rule."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re

import aiohttp
from aiohttp import web
from PIL import Image

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.video.simple_decoder import decode
from epd.video.types import SamplingOptions
from tests.media import make_video


async def _session(api_key: str, fn):
    config = GatewayConfig(http=HttpApiConfig(port=0, api_keys=(api_key,) if api_key else ()))
    api = HttpApi(config, Pipeline(None, None, None), GatewayMetrics())  # type: ignore[arg-type]
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            return await fn(session)
    finally:
        await runner.cleanup()


def test_page_static_files_and_samples():
    async def calls(session):
        out = {}
        for path in (
            "/",
            "/static/app.js",
            "/static/style.css",
            "/demo/samples",
            "/demo/samples/sample.mp4",
            "/demo/samples/..%2Fpyproject.toml",
            "/demo/samples/nope.mp4",
        ):
            async with session.get(path) as resp:
                out[path] = (resp.status, await resp.read())
        return out

    out = asyncio.run(_session("", calls))
    assert out["/"][0] == 200 and b'<script src="/static/app.js">' in out["/"][1]
    assert out["/static/app.js"][0] == 200 and b"kept_tokens" in out["/static/app.js"][1]
    assert out["/static/style.css"][0] == 200
    samples = {s["name"]: s for s in __import__("json").loads(out["/demo/samples"][1])["samples"]}
    assert samples["sample.mp4"]["kind"] == "video" and samples["sample.png"]["kind"] == "image"
    assert "what colour is the circle?" in samples["sample.mp4"]["questions"]
    assert out["/demo/samples/sample.mp4"][0] == 200
    assert len(out["/demo/samples/sample.mp4"][1]) == samples["sample.mp4"]["num_bytes"]
    assert out["/demo/samples/..%2Fpyproject.toml"][0] == 404
    assert out["/demo/samples/nope.mp4"][0] == 404


def test_a_missing_static_file_or_sample_is_a_json_404_counted_as_one():
    """aiohttp's add_static answered a name it has no file for with an empty octet-stream 404, set
    only as its FileResponse was sent: after the middleware had logged and counted it as a 200,
    with no JSON error and no request id. A missing sample's 404 named no request id either."""
    paths = (
        "/static/nope.js",
        "/static/..%2Fhttp_api.py",
        "/static/%25",
        "/static/app.js%00",
        "/demo/samples/nope.mp4",
    )

    async def calls(session):
        out = {}
        for method in ("GET", "HEAD"):
            for path in paths:
                async with session.request(method, path) as resp:
                    out[method, path] = (resp.status, await resp.read())
        async with session.get("/metrics") as resp:
            return out, await resp.text()

    out, metrics = asyncio.run(_session("", calls))
    for (method, path), (status, body) in out.items():
        assert status == 404, (method, path, status)
        if method == "GET":
            message = json.loads(body)["error"]["message"]
            assert "no " in message and "request id" in message, (path, message)
    counted = re.findall(
        r'epd_http_responses_total\{code="(\d+)",route="(/static[^"]*|/demo/samples[^"]*)"\} (\S+)', metrics
    )
    assert {(code, float(n)) for code, _, n in counted} == {("404", 8.0), ("404", 2.0)}, counted


def test_a_page_file_or_sample_is_answered_whole_whatever_its_range_header():
    """A Range header aiohttp's FileResponse could not read or meet ("{", bytes past the end) was
    an empty 416 of no JSON, decided as it was sent: counted as a 200. Range is ignored (RFC 9110
    allows it; the page fetches its files whole): the whole file, 200, counted as one."""
    paths = ("/", "/static/app.js", "/demo/samples/sample.png")

    async def calls(session):
        out = {}
        for path in paths:
            for value in ("{", "bytes=999999999-", "bytes=5-1", "bytes=0-3"):
                async with session.get(path, headers={"Range": value}) as resp:
                    out[path, value] = (
                        resp.status,
                        len(await resp.read()),
                        resp.headers.get("Content-Range"),
                    )
            async with session.get(path) as resp:
                out[path] = len(await resp.read())
        async with session.get("/metrics") as resp:
            return out, await resp.text()

    out, metrics = asyncio.run(_session("", calls))
    for key, answer in out.items():
        if isinstance(key, tuple):
            assert answer == (200, out[key[0]], None), (key, answer)
    counted = re.findall(
        r'epd_http_responses_total\{code="(\d+)",route="(/|/static[^"]*|/demo/samples[^"]*)"\} (\S+)', metrics
    )
    assert sorted(counted) == [
        ("200", route, "5.0") for route in ("/", "/demo/samples/{name}", "/static/{name}")
    ]


def test_every_response_forbids_framing_sniffing_and_other_origins():
    """The page holds an API key and had no Content-Security-Policy, X-Frame-Options or nosniff:
    any site could frame it (clickjacking the key's owner), a script from anywhere could run in
    it had anything been injected, and a sample or an error could be sniffed into HTML."""

    async def calls(session):
        out = {}
        for method, path in (
            ("GET", "/"),
            ("GET", "/static/app.js"),
            ("GET", "/demo/samples/sample.png"),
            ("POST", "/demo/frames"),
            ("GET", "/nope"),
        ):
            async with session.request(method, path) as resp:
                out[path] = (resp.status, resp.headers)
        return out

    out = asyncio.run(_session("k", calls))
    assert out["/demo/frames"][0] == 401 and out["/nope"][0] == 404
    for path, (_, headers) in out.items():
        csp = {
            d.split()[0]: d.split()[1:] for d in headers.get("Content-Security-Policy", "").split("; ") if d
        }
        assert csp.get("default-src") == ["'none'"] and csp.get("frame-ancestors") == ["'none'"], path
        # the key stays here
        assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"], path
        assert headers.get("X-Content-Type-Options") == "nosniff", path
        assert headers.get("X-Frame-Options") == "DENY", path
    assert out["/static/app.js"][1]["Content-Type"] in ("application/javascript", "text/javascript")


def test_a_page_of_another_site_cannot_make_a_keyless_gateway_work(monkeypatch):
    """A page on any site could POST (mode no-cors, text/plain) to a keyless gateway on the
    visitor's loopback and have it decode and generate, blind, as often as it liked. Browsers
    say where a request comes from (Sec-Fetch-Site): another site's or origin's is refused
    before its body is read; the gateway's own page, and clients that are not browsers, go on."""
    from epd.gateway.web import routes

    decodes = []
    monkeypatch.setattr(routes, "sampled_thumbnails", lambda *a: decodes.append(a) or {"frames": []})
    body = {"video_url": "data:image/png;base64,AAAA"}

    async def calls(session):
        out = {}
        for path in ("/demo/frames", "/v1/chat/completions"):
            for site in ("cross-site", "same-site", "same-origin", "none", None):
                # text/plain: what a page may POST without a CORS preflight (refused 415 when not
                # refused 403 first, so the calls the guard lets through send JSON).
                content_type = "text/plain" if site in ("cross-site", "same-site") else "application/json"
                headers = {"Content-Type": content_type} | ({"Sec-Fetch-Site": site} if site else {})
                async with session.post(path, data=__import__("json").dumps(body), headers=headers) as resp:
                    out[path, site] = (resp.status, (await resp.json()).get("error", {}).get("message", ""))
        return out

    out = asyncio.run(_session("", calls))
    for path in ("/demo/frames", "/v1/chat/completions"):
        for site in ("cross-site", "same-site"):
            assert out[path, site][0] == 403 and "another site" in out[path, site][1], (path, site)
        for site in ("same-origin", "none", None):
            assert out[path, site][0] != 403, (path, site, out[path, site])
    assert len(decodes) == 3  # the same-origin, "none" (typed in) and non-browser calls only


def test_a_keyless_gateway_on_loopback_answers_loopback_names_only():
    """DNS rebinding: a page whose domain the attacker re-points at 127.0.0.1 is same-origin with
    a keyless `epd serve` on loopback, so it could use the API and read every answer (Sec-Fetch-Site
    says same-origin). Such a request names the attacker's domain in its Host header."""

    async def calls(session):
        out = {}
        for host in (
            "evil.example",
            "evil.example:8000",
            "127.0.0.1.nip.io",
            "localhost:8000",
            "LOCALHOST.",
            "app.localhost",
            "127.0.0.1",
            "127.0.0.2:9",
            "[::1]:8000",
        ):
            async with session.get("/v1/models", headers={"Host": host}) as resp:
                out[host] = (resp.status, (await resp.json()).get("error", {}).get("message", ""))
        return out

    out = asyncio.run(_session("", calls))
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io"):
        assert out[host][0] == 403 and "loopback clients only" in out[host][1], (host, out[host])
    for host in ("localhost:8000", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.0.0.2:9", "[::1]:8000"):
        assert out[host][0] == 200, (host, out[host])

    async def keyed(session):  # with a key (or --no-api-key) it may serve any name: no check
        async with session.get("/", headers={"Host": "gateway.example"}) as resp:
            return resp.status

    assert asyncio.run(_session("k", keyed)) == 200


def test_frames_are_the_encoders_sampled_frames_as_thumbnails(tmp_path):
    video = make_video(tmp_path / "clip.mp4", codec="h264", size=(320, 240), fps=10.0, seconds=3.0, gop=10)
    data = video.read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()

    async def calls(session):
        out = []
        for body, headers in (
            ({"video_url": url, "media": {"num_frames": 5}}, {}),
            ({"video_url": url, "media": {"num_frames": 5}}, {"Authorization": "Bearer k"}),
            ({"video_url": url, "media": {"frames": 5}}, {"Authorization": "Bearer k"}),
            ({"video_url": "/etc/passwd"}, {"Authorization": "Bearer k"}),
        ):
            async with session.post("/demo/frames", json=body, headers=headers) as resp:
                out.append((resp.status, await resp.json()))
        return out

    (no_key, unauthorized), (ok, body), (bad_option, error), (local_path, refused) = asyncio.run(
        _session("k", calls)
    )
    assert no_key == 401
    # Checked with /v1/*'s, before admission: its message names the request id as every error does.
    assert re.search(r"missing or wrong API key; .* \(request id \w+\)$", unauthorized["error"]["message"])
    assert ok == 200 and (body["width"], body["height"]) == (320, 240)
    expected = decode(data, SamplingOptions(num_frames=5))
    assert [f["timestamp_s"] for f in body["frames"]] == expected.timestamps_s
    thumb = Image.open(io.BytesIO(base64.b64decode(body["frames"][0]["jpeg_base64"])))
    assert thumb.format == "JPEG" and thumb.size == (192, 144)
    assert bad_option == 400 and "unknown media options ['frames']" in error["error"]["message"]
    assert local_path == 403
