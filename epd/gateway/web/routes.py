"""The web demo, served by the front door's HTTP server next to the OpenAI API:

    GET  /                        the page (static/index.html; plain HTML/CSS/JS, no build, no CDN),
                                  served, as every response, with `SECURITY_HEADERS` (a CSP of
                                  its own origin only, no framing, nosniff)
    GET  /static/{name}           its script and style sheet (the files of static/ by name only;
                                  any other name, a path or a traversal is the API's JSON 404)
    GET  /demo/samples            the bundled samples (samples/): name, kind, size, suggested questions
    GET  /demo/samples/{name}     one sample's bytes
    POST /demo/frames             {"video_url": "data:...", "media": {...}} -> the frames the
                                  encoder samples with these options, as small base64 JPEGs
                                  with their timestamps (same parser and defaults as
                                  /v1/chat/completions, same frame selection rule), decoded
                                  under the gateway's decode limits on the demo's own threads
                                  (`demo_decodes.py`: a bounded number at once, stopped when
                                  the client goes away, its admission slot held until then)

The page asks its questions through the streaming `/v1/chat/completions` (SSE) and draws the
final chunk's `epd` object (the SDK's `AskResult` fields under the same names, see
`summary_fields.epd_details`): `timings_ms` by `epd.stages.names` stage (timeline), frames,
cache hit, and `kept_tokens`. Questions about one clip are a conversation kept by the page: each
request's `messages` carry the earlier questions and answers (nothing is stored here), and the
usage chunk's `prompt_tokens_details.cached_tokens` shows what prefill's prefix cache reused.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import mimetypes
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web

from epd.gateway.admission import max_body_bytes as gateway_max_body_bytes
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.config import GatewayConfig
from epd.gateway.http_body import TICKET_KEY, defer_continue, read_json_body
from epd.gateway.http_error_responses import exception_response, json_error
from epd.gateway.media_fetch import load_media
from epd.gateway.web.demo_decodes import DemoDecodes
from epd.model_runtime.sampling import GenerationConfig
from epd.resources import shipped
from epd.stages.errors import InvalidRequest
from epd.video.types import DecodeCancelled, DecodeLimits, SamplingOptions

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = frozenset(path.name for path in STATIC_DIR.iterdir() if path.is_file())
"""What GET /static/{name} serves, by name."""
SAMPLES_DIR = shipped("samples")
THUMBNAIL_MAX_SIDE = 192
"""Longest side of a frame thumbnail, in pixels."""
_SAMPLE_SUFFIXES = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".png", ".jpg", ".jpeg"}


BODY_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/demo/frames", "/tokenize", "/detokenize"}
)
"""Routes whose POST body is read with `read_json_body` under the admission limits."""

SECURITY_HEADERS = {
    # The page holds an API key: its own script, style sheet and origin only (the thumbnails are
    # data: URLs; the script sets styles through the DOM, which style-src does not block), and
    # no other site may frame it (clickjacking) or sniff a sample or an error into HTML.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers without CSP level 2
    "Referrer-Policy": "no-referrer",
}
"""On every response of the HTTP server (the API's JSON too: harmless there, and no route is missed)."""


def add_demo_routes(
    app: web.Application,
    config: GatewayConfig,
    max_body_bytes: int | None = None,
    samples_dir: Path = SAMPLES_DIR,
) -> None:
    demo = WebDemo(config, samples_dir, max_body_bytes or gateway_max_body_bytes(config.max_upload_bytes))
    app.router.add_get("/", demo.index, expect_handler=defer_continue)
    # Not aiohttp's add_static, whose FileResponse answered a missing file late (`file_answer`).
    app.router.add_get("/static/{name}", demo.static_file, expect_handler=defer_continue)
    app.router.add_get("/demo/samples", demo.samples, expect_handler=defer_continue)
    app.router.add_get("/demo/samples/{name}", demo.sample, expect_handler=defer_continue)
    app.router.add_post("/demo/frames", demo.frames, expect_handler=defer_continue)

    async def stop_decodes(_: web.Application) -> None:
        demo.decodes.close()

    app.on_cleanup.append(stop_decodes)
    app.on_response_prepare.append(add_security_headers)


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


class WebDemo:
    def __init__(self, config: GatewayConfig, samples_dir: Path, max_body_bytes: int) -> None:
        self.config = config
        self.samples_dir = samples_dir
        self.max_body_bytes = max_body_bytes
        self.decodes = DemoDecodes(config.http.demo.max_concurrent_decodes)
        self.limits = replace(config.http.demo.limits, max_bytes=config.max_upload_bytes)

    async def index(self, request: web.Request) -> web.Response:
        return await file_answer(STATIC_DIR / "index.html", {"Cache-Control": "no-cache"})

    async def samples(self, request: web.Request) -> web.Response:
        return web.json_response({"samples": list_samples(self.samples_dir)})

    async def static_file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC_FILES:  # only the page's files: no path ever comes from the URL
            return json_error(404, f"no file named {name[:200]!r} in /static/", "not_found_error")
        return await file_answer(STATIC_DIR / name)

    async def sample(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        names = {s["name"] for s in list_samples(self.samples_dir)}
        if name not in names:  # only listed files: no path ever comes from the URL
            message = f"no sample named {name[:200]!r}; GET /demo/samples lists them"
            return json_error(404, message, "not_found_error")
        return await file_answer(self.samples_dir / name)

    async def frames(self, request: web.Request) -> web.Response:
        """Behind the API key with /v1/* (the HTTP API's middleware checks it before admission)."""
        try:
            sampling, url = _frames_request(
                await read_json_body(request, self.max_body_bytes, self.config.body_timeout_s), self.config
            )
            ticket = request.get(TICKET_KEY)
            data = await load_media(
                url,
                self.config.http.media,
                self.config.max_upload_bytes,
                ticket.reserve_bytes if ticket is not None else None,
            )
            thumbnails = await self.decodes.run(
                sampled_thumbnails, data, sampling, self.limits, ticket=ticket
            )
            return web.json_response(thumbnails)
        except Exception as exc:  # noqa: BLE001 - mapped like the OpenAI API's errors
            return exception_response(exc)


async def file_answer(path: Path, headers: dict[str, str] | None = None) -> web.Response:
    """A page file or a bundled sample (tens of kB), whole, with its status final before the HTTP
    API's middleware logs and counts it. aiohttp's FileResponse decided its 404 (no such file) or
    416 (a Range header it could not read) only as it was sent, after both: an empty body of no
    JSON, counted as a 200. Range and conditional headers are ignored, as RFC 9110 allows: 200."""
    try:
        body = await asyncio.to_thread(path.read_bytes)
    except OSError:  # a sample removed since it was listed
        return json_error(404, f"{path.name!r} is gone", "not_found_error")
    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return web.Response(body=body, content_type=content_type, headers=headers)


def _frames_request(body: Any, config: GatewayConfig) -> tuple[SamplingOptions, str]:
    """Reuse the chat-completions parser so that sampling defaults and checks are the same."""
    if not isinstance(body, dict) or not isinstance(body.get("video_url"), str):
        raise InvalidRequest('send {"video_url": "data:...", "media": {...}}')
    chat = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "frames"},
                                         {"type": "video_url", "video_url": {"url": body["video_url"]}}]}
        ],
        "media": body.get("media"),
    }  # fmt: skip
    # only its media sampling is read: the generation defaults play no part
    parsed = parse_chat_request(chat, config.http.served_model_name, config.sampling, GenerationConfig())
    return parsed.sampling, parsed.media_url


def sampled_thumbnails(
    data: bytes, sampling: SamplingOptions, limits: DecodeLimits, cancel: threading.Event | None = None
) -> dict[str, Any]:
    """{"frames": [{"timestamp_s", "jpeg_base64"}], "width", "height"} of the sampled frames;
    DecodeCancelled soon after `cancel` is set."""
    # Imported here, as PIL: the demo's thumbnails are the gateway's only use of numpy and the
    # decoder, and a gateway that never shows them should not hold them (~15 MB RSS per process).
    from PIL import Image

    from epd.video.simple_decoder import decode

    # Decode straight to about twice the thumbnail size (same frames, same aspect): a repeated
    # frame is copied into each of the T slots, so full-size frames would cost T x H x W x 3.
    thumb_pixels = (2 * THUMBNAIL_MAX_SIDE) ** 2
    max_pixels = min(sampling.max_pixels or thumb_pixels, thumb_pixels)
    # frames: [T, h, w, 3] uint8
    video = decode(data, replace(sampling, max_pixels=max_pixels), limits, cancel)
    out = []
    height, width = int(video.frames.shape[1]), int(video.frames.shape[2])
    scale = min(1.0, THUMBNAIL_MAX_SIDE / max(height, width))
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    for frame, timestamp_s in zip(video.frames, video.timestamps_s):
        if cancel is not None and cancel.is_set():
            raise DecodeCancelled("cancelled while making thumbnails")
        buf = io.BytesIO()
        Image.fromarray(frame).resize(size, Image.Resampling.BILINEAR).save(buf, format="JPEG", quality=75)
        out.append(
            {"timestamp_s": float(timestamp_s), "jpeg_base64": base64.b64encode(buf.getvalue()).decode()}
        )
    return {"frames": out, "width": width, "height": height, "is_image": video.is_image}


def list_samples(samples_dir: Path) -> list[dict[str, Any]]:
    """The media files in `samples_dir`, with the questions its sample.json suggests."""
    if not samples_dir.is_dir():
        return []
    questions: dict[str, list[str]] = {}
    meta_path = samples_dir / "sample.json"
    if meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            for entry in meta.values():
                if isinstance(entry, dict) and "file" in entry:
                    questions[entry["file"]] = [q["question"] for q in entry.get("questions", [])]
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # suggestions are optional
    out = []
    for path in sorted(samples_dir.iterdir()):
        if path.is_file() and path.suffix.lower() in _SAMPLE_SUFFIXES:
            mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            out.append({
                "name": path.name,
                "kind": "image" if mime.startswith("image/") else "video",
                "mime_type": mime,
                "num_bytes": path.stat().st_size,
                "questions": questions.get(path.name, []),
            })  # fmt: skip
    return out
