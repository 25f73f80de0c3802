"""The web demo in headless Chromium (Debian's, driven by Playwright) against a real stack with
the HTTP port on: upload a video, see the sampled frames, ask, watch the answer stream in, see
the kept-token overlay and the stage timeline; a follow-up hits the encoder's cache; a bundled
sample works the same way.

Needs Chromium and Playwright (tests/e2e/chromium.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epd.client import EpdClient
from tests.e2e import chromium  # noqa: F401 - skips this module without Chromium and Playwright
from tests.stack import Stack

API_KEY = "demo-key"
QUESTION = "what colour is the moving square?"
NUM_FRAMES = 4
MAX_TOKENS = 8
SCREENSHOT = Path("/tmp/epd_web_demo.png")
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--api-key", API_KEY]}
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_web"), extra=extra, http=True) as s:
        s.http_url = f"http://127.0.0.1:{s.http_port}/"
        yield s


@pytest.fixture
def page(browser, stack):
    with chromium.checked_page(browser, TIMEOUT_MS) as page:
        page.goto(stack.http_url)
        page.fill("#api-key", API_KEY)
        page.fill("#num-frames", str(NUM_FRAMES))
        page.fill("#max-tokens", str(MAX_TOKENS))
        yield page


def _ask(page, question: str) -> dict:
    """Ask on the page; returns the newest answer card's text, how often it changed, badges."""
    page.evaluate(
        """() => {
            window.__textUpdates = 0;
            const seen = new WeakSet();
            new MutationObserver(() => {
                const t = document.querySelector('#answers .answer-text');
                if (t && t.textContent && !seen.has(t)) { window.__textUpdates = 0; seen.add(t); }
                window.__textUpdates += 1;
            }).observe(document.getElementById('answers'), {subtree: true, childList: true, characterData: true});
        }"""
    )
    page.fill("#question", question)
    page.click("#ask")
    page.wait_for_selector("#answers .answer:first-child .answer-text:not(.streaming)")
    page.wait_for_selector("#answers .answer:first-child .stage-bar")
    card = page.locator("#answers .answer").first
    return {
        "text": card.locator(".answer-text").text_content(),
        "updates": page.evaluate("window.__textUpdates"),
        "badges": card.locator(".badge").all_text_contents(),
        "stages": card.locator(".stage-bar").evaluate_all("bars => bars.map(b => b.dataset.stage)"),
    }


def test_upload_ask_stream_frames_overlay_timeline_and_cached_follow_up(page, stack, media_files):
    page.set_input_files("#file-input", str(media_files["mp4"]))
    page.wait_for_function(f"() => document.querySelectorAll('#frames .frame img').length === {NUM_FRAMES}")
    assert "clip.mp4" in page.text_content("#media-info")

    first = _ask(page, QUESTION)
    assert first["text"]
    assert first["updates"] >= 2, "the answer should appear piece by piece as tokens stream in"
    assert first["stages"] == ["video_decode", "encode", "prefill", "kv_transfer", "generate"]
    assert "cache miss: video encoded" in first["badges"]
    assert f"{NUM_FRAMES} frames" in first["badges"]

    # Overlay: no kept_tokens from the server yet (token dropping off) -> every token kept, one
    # grid per frame, num_visual_tokens / ceil(frames / 2) cells each.
    num_visual_tokens = int(next(b for b in first["badges"] if b.endswith("visual tokens")).split()[0])
    per_group = num_visual_tokens // ((NUM_FRAMES + 1) // 2)
    assert page.locator("#frames .token-grid").count() == NUM_FRAMES
    assert page.locator("#frames .token.kept").count() == NUM_FRAMES * per_group
    assert page.locator("#frames .token.dropped").count() == 0
    assert "all" in page.text_content("#overlay-legend")

    follow_up = _ask(page, "and what happens at the end?")
    assert "cache hit: video reused" in follow_up["badges"]
    assert page.locator("#answers .answer").count() == 2
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    # The page's answer is the API's answer: same tokens as the gRPC SDK with the same options.
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as client:
        expected = client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS)
    assert first["text"] == expected.answer


def test_kept_tokens_from_the_server_shade_the_dropped_ones(page, media_files):
    page.set_input_files("#file-input", str(media_files["mp4"]))
    page.wait_for_function(f"() => document.querySelectorAll('#frames .frame img').length === {NUM_FRAMES}")
    # The `epd.kept_tokens` contract: kept[t][row][col]; frames 0-1 -> group 0, frames 2-3 -> group 1.
    kept = [[[1, 0, 1], [0, 1, 0]], [[0, 0, 0], [1, 1, 1]]]
    page.evaluate("kept => renderFrames({num_visual_tokens: 12, num_frames: 4, kept_tokens: kept})", kept)
    grids = page.locator("#frames .token-grid")
    assert grids.count() == NUM_FRAMES
    dropped_per_frame = [grids.nth(i).locator(".token.dropped").count() for i in range(NUM_FRAMES)]
    assert dropped_per_frame == [3, 3, 3, 3]
    first_frame_cells = grids.nth(0).locator(".token").evaluate_all("cs => cs.map(c => c.className)")
    assert first_frame_cells == ["token kept", "token dropped", "token kept", "token dropped", "token kept",
                                 "token dropped"]  # fmt: skip
    assert page.text_content("#overlay-legend").startswith("token dropping kept 6 of 12")
    page.locator("#media-panel").screenshot(path=str(SCREENSHOT.with_name("epd_web_demo_kept.png")))


def test_a_bundled_sample_with_suggested_questions(page):
    page.select_option("#sample-select", "sample.mp4")
    page.click("#use-sample")
    page.wait_for_function(f"() => document.querySelectorAll('#frames .frame img').length === {NUM_FRAMES}")
    page.click("#suggestions .suggestion >> nth=0")
    assert page.input_value("#question") == "what colour is the circle?"
    page.click("#ask")
    page.wait_for_selector("#answers .answer .answer-text:not(.streaming)")
    page.wait_for_selector("#answers .answer .stage-bar[data-stage=generate]")
    assert page.locator("#answers .answer .answer-text").text_content()


def test_a_wrong_api_key_shows_the_servers_message(page, media_files):
    page.fill("#api-key", "not-the-key")
    page.set_input_files("#file-input", str(media_files["mp4"]))
    page.wait_for_selector("#error:not([hidden])")
    assert "missing or wrong API key" in page.text_content("#error")


def test_a_follow_up_sends_the_conversation_and_new_conversation_starts_over(page, media_files):
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None,
    )
    page.set_input_files("#file-input", str(media_files["mp4"]))
    page.wait_for_function(f"() => document.querySelectorAll('#frames .frame img').length === {NUM_FRAMES}")
    first = _ask(page, QUESTION)
    second = _ask(page, "and which appears first?")
    assert page.locator("#answers .answer").count() == 2
    assert {b.split()[0] for b in second["badges"]} >= {"TTFT", "total"}

    # The second request carries the first question and its answer, then the new question.
    assert [len(b["messages"]) for b in bodies] == [1, 3]
    user1, assistant, user2 = bodies[1]["messages"]
    assert user1["role"] == "user" and [p["type"] for p in user1["content"]] == ["video_url", "text"]
    assert user1["content"][1]["text"] == QUESTION
    assert (
        user1["content"][0]["video_url"]["url"] == bodies[0]["messages"][0]["content"][0]["video_url"]["url"]
    )
    assert assistant == {"role": "assistant", "content": first["text"]}
    assert user2 == {"role": "user", "content": [{"type": "text", "text": "and which appears first?"}]}
    assert bodies[1]["stream_options"] == {"include_usage": True}
    assert "2 earlier questions" in page.text_content("#conversation-info")

    page.click("#new-conversation")
    assert page.locator("#answers .answer").count() == 0
    _ask(page, "what happens at the end?")
    assert len(bodies[2]["messages"]) == 1 and bodies[2]["messages"][0]["content"][0]["type"] == "video_url"


def test_the_reused_prefix_badge(page):
    """The prefix cache's count comes as usage.prompt_tokens_details.cached_tokens (OpenAI's
    name) or in the `epd` object; a turn with none shows no badge."""
    reused = page.evaluate("""() => [
        reusedPromptTokens({prompt_tokens_details: {cached_tokens: 42}}, {}),
        reusedPromptTokens(null, {num_reused_prompt_tokens: 7}),
        reusedPromptTokens({prompt_tokens: 9}, {}),
    ]""")
    assert reused == [42, 7, 0]
    badges = page.evaluate("""() => {
        const box = document.createElement('div');
        renderBadges(box, {num_frames: 4, num_visual_tokens: 8, timings_ms: {ttft: 12.3, total: 45.6}}, 42);
        const none = document.createElement('div');
        renderBadges(none, {num_frames: 4, num_visual_tokens: 8, timings_ms: {}}, 0);
        return [[...box.children].map(b => b.textContent), none.textContent];
    }""")
    assert (
        "reused prefix: 42 tokens" in badges[0] and "TTFT 12 ms" in badges[0] and "total 46 ms" in badges[0]
    )
    assert "reused prefix" not in badges[1]


def test_another_clip_chosen_while_an_answer_streams_starts_a_clean_conversation(page, media_files):
    """The old clip's answer, finishing after the new clip was chosen, joined the new clip's
    conversation: its next question went out with the old question and answer under the new
    clip. The page's fetch holds the answer back until the new clip is in, so the race is certain."""
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None,
    )
    page.set_input_files("#file-input", str(media_files["mp4"]))
    page.wait_for_function(f"() => document.querySelectorAll('#frames .frame img').length === {NUM_FRAMES}")
    page.evaluate(
        """() => {
            const realFetch = window.fetch;
            const released = new Promise((resolve) => { window.__release = resolve; });
            window.fetch = async (url, options) => {
                const response = await realFetch(url, options);
                if (url === '/v1/chat/completions') { window.__held = true; await released; }
                return response;
            };
        }"""
    )
    page.fill("#question", QUESTION)
    page.click("#ask")
    page.wait_for_function("() => window.__held === true")
    page.set_input_files("#file-input", str(media_files["mp4_b"]))
    page.wait_for_function("() => document.getElementById('media-info').textContent.includes('clip_b.mp4')")
    page.wait_for_function("() => state.framesKey !== ''")  # the new clip's frames are in
    page.evaluate("window.__release()")
    page.wait_for_function("() => !state.busy")  # the old answer has ended
    assert page.evaluate("state.turns") == []
    assert "new conversation" in page.text_content("#conversation-info")

    _ask(page, "what happens at the end?")
    assert len(bodies) == 2 and len(bodies[1]["messages"]) == 1  # no turn of the old clip's
    new_clip = bodies[1]["messages"][0]["content"][0]["video_url"]["url"]
    assert new_clip != bodies[0]["messages"][0]["content"][0]["video_url"]["url"]
