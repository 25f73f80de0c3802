"""The web demo's page in headless Chromium against an in-process HTTP API with no stages (the
page, its files, the samples and `POST /demo/frames` need none): the page works under its own
Content-Security-Policy, keeps the API key out of storage, and says when an answer's stream
fails or is cut short. Answers are stood in for by the page's own `fetch`, so no model runs.

Needs Chromium and Playwright (tests/e2e/chromium.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from tests.e2e import chromium  # noqa: F401 - skips this module without Chromium and Playwright

API_KEY = "page-key"
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    """The gateway's HTTP app (no pipeline behind it) on a loop of its own thread (Playwright's
    sync API runs a loop on this one)."""
    loop = asyncio.new_event_loop()
    config = GatewayConfig(http=HttpApiConfig(port=0, api_keys=(API_KEY,)))
    runner = web.AppRunner(HttpApi(config, Pipeline(None, None, None), GatewayMetrics()).app())  # type: ignore[arg-type]

    async def start() -> int:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture
def page(browser, http_url):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.console_messages = []  # type: ignore[attr-defined]
    page.on("console", lambda m: page.console_messages.append(m.text))  # type: ignore[attr-defined]
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(http_url)
    yield page
    context.close()
    assert not errors, errors


def _use_sample(page) -> None:
    page.fill("#api-key", API_KEY)
    page.fill("#num-frames", "2")
    page.select_option("#sample-select", "sample.mp4")
    page.click("#use-sample")
    page.wait_for_function("() => document.querySelectorAll('#frames .frame img').length === 2")


def test_the_page_works_under_its_content_security_policy(page):
    """Samples listed, frames fetched with the key and drawn as data: images, the token overlay
    styled from the script: nothing the policy blocks (Chromium logs each violation)."""
    _use_sample(page)
    page.evaluate("renderFrames({num_visual_tokens: 8, num_frames: 2, kept_tokens: [[[1, 0], [0, 1]]]})")
    assert page.locator("#frames .token.dropped").count() == 4
    assert page.evaluate("document.querySelector('#frames img').naturalWidth") > 0
    violations = [m for m in page.console_messages if "Content Security Policy" in m]
    assert not violations, violations


def test_the_api_key_is_not_stored(page, http_url):
    """The key was kept in localStorage: on disk after the tab closed, for any script of the
    origin to read. It stays in the page's memory only, and an old stored key is removed."""
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    _use_sample(page)
    assert page.evaluate("JSON.stringify(localStorage)") == "{}"
    assert page.evaluate("JSON.stringify(sessionStorage)") == "{}"
    page.evaluate("localStorage.setItem('epd-api-key', 'left-by-an-old-page')")
    page.goto(http_url)
    assert page.input_value("#api-key") == ""
    assert page.evaluate("localStorage.getItem('epd-api-key')") is None


def _answer_with(page, sse_body: str) -> None:
    """Ask, with /v1/chat/completions answered by `sse_body` (a 200 event stream)."""
    page.evaluate(
        """(body) => {
            const realFetch = window.fetch;
            window.fetch = (url, options) => url === '/v1/chat/completions'
                ? Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}))
                : realFetch(url, options);
        }""",
        sse_body,
    )
    page.fill("#question", "what colour is the circle?")
    page.click("#ask")
    page.wait_for_function("() => !state.busy")


def _chunk(delta: dict) -> str:
    import json

    return "data: " + json.dumps(
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    )


def test_an_error_event_mid_stream_is_shown_and_the_turn_not_kept(page):
    _use_sample(page)
    error = '{"error": {"message": "the decode replica failed after 1 tokens (request id r1)", "code": 502}}'
    _answer_with(page, f"{_chunk({'content': 'a red'})}\n\ndata: {error}\n\ndata: [DONE]\n\n")
    assert "decode replica failed" in page.text_content("#error")
    assert page.evaluate("state.turns") == []
    assert page.locator("#answers .answer-text.streaming").count() == 0


def test_a_stream_cut_short_says_so(page):
    """A stream that ended without its final chunk and [DONE] looked like a whole answer."""
    _use_sample(page)
    _answer_with(
        page, f"{_chunk({'role': 'assistant', 'content': ''})}\n\n{_chunk({'content': 'a red'})}\n\n"
    )
    assert "ended before the answer was complete" in page.text_content("#error")
    assert page.evaluate("state.turns") == []


def test_another_clip_stops_the_answer_streaming_for_the_old_one(page):
    """Choosing another clip mid-answer left the old request generating on the server until its
    max_tokens: the page now aborts its fetch (the server's handler is cancelled with it)."""
    _use_sample(page)
    page.evaluate(
        """(first) => {
            const realFetch = window.fetch;
            window.fetch = (url, options) => {
                if (url !== '/v1/chat/completions') return realFetch(url, options);
                window.__signal = options.signal || null;
                const body = new ReadableStream({start(controller) {  // one token, then nothing
                    controller.enqueue(new TextEncoder().encode(first + '\\n\\n'));
                    if (options.signal) options.signal.addEventListener('abort',
                        () => controller.error(new DOMException('aborted', 'AbortError')));
                }});
                return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
            };
        }""",
        _chunk({"content": "a red"}),
    )
    page.fill("#question", "what colour is the circle?")
    page.click("#ask")
    page.wait_for_function("() => window.__signal !== undefined && state.busy")
    page.select_option("#sample-select", "sample.png")
    page.click("#use-sample")
    page.wait_for_function("() => !state.busy", timeout=10_000)
    assert page.evaluate("window.__signal !== null && window.__signal.aborted")
    assert page.is_hidden("#error"), page.text_content("#error")
    assert page.evaluate("state.turns") == [] and page.locator("#answers .answer").count() == 0


def test_another_clip_aborts_the_frames_request_of_the_old_one(page):
    """Picking another clip while the first one's frames were being decoded left that decode
    running (holding one of the demo's --demo-max-concurrent-decodes slots: switch twice and the
    next clip got 429), and its thumbnails, arriving last, replaced the new clip's."""
    page.fill("#api-key", API_KEY)
    page.evaluate(
        """() => {
            const realFetch = window.fetch;
            window.__frames = [];
            window.fetch = async (url, options) => {
                if (url !== '/demo/frames') return realFetch(url, options);
                const call = {signal: options.signal || null, url: JSON.parse(options.body).video_url};
                window.__frames.push(call);
                const response = await realFetch(url, options);
                if (window.__frames.length === 1) await new Promise((r) => { window.__releaseFirst = r; });
                return response;
            };
        }"""
    )
    page.select_option("#sample-select", "sample.mp4")
    page.click("#use-sample")
    page.wait_for_function("() => window.__releaseFirst !== undefined")
    page.select_option("#sample-select", "sample.png")
    page.click("#use-sample")
    page.wait_for_function("() => state.framesKey !== '' && window.__frames.length === 2")
    new_frames = page.evaluate("JSON.stringify(state.frames)")
    page.evaluate("window.__releaseFirst()")  # the old clip's answer arrives last
    page.wait_for_function("() => state.framesLoading === null")
    assert page.evaluate("window.__frames[0].signal !== null && window.__frames[0].signal.aborted")
    assert page.evaluate("JSON.stringify(state.frames)") == new_frames
    assert page.evaluate("state.frames.is_image") and page.locator("#frames .frame img").count() == 1
    assert page.is_hidden("#error"), page.text_content("#error")


def test_reasoning_under_either_name_is_shown_once_in_the_thinking_block(page):
    """vLLM names the reasoning delta `reasoning`, its older versions `reasoning_content`; epd
    sends both with the same text: the page shows it once, from either, and keeps the content."""
    _use_sample(page)
    _answer_with(
        page,
        "\n\n".join([
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"reasoning": "let me ", "reasoning_content": "let me "}),
            _chunk({"reasoning_content": "see"}),
            _chunk({"content": "red"}),
            'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "epd": {"num_frames": 2, '
            '"num_visual_tokens": 8, "timings_ms": {}}}',
            "data: [DONE]",
            "",
        ]),
    )  # fmt: skip
    assert page.is_hidden("#error"), page.text_content("#error")
    card = page.locator("#answers .answer").first
    assert card.locator(".thinking-text").text_content() == "let me see"
    assert card.locator(".answer-text").text_content() == "red"
    assert page.evaluate("state.turns") == [{"question": "what colour is the circle?", "answer": "red"}]
