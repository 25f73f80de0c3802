"""The web demo in headless Chromium against a real stack serving the tiny Qwen3.5 with
`--reasoning-parser qwen3` (its template opens a thinking block): the answer's reasoning streams
into a collapsible "Thinking" block above the answer, the answer is the content alone, and a
follow-up sends the content alone back as the assistant's turn; "token probabilities" asks for
logprobs and shades each streamed piece, its tooltip listing the most likely alternatives.

The tiny model is random: an answer that holds `</think>` between reasoning and content is made
by `allowed_token_ids` (two ordinary tokens and `</think>`), found with the page's own request
body and added to the page's requests by its fetch; the stack, the stream and the page are real.

Needs Chromium and Playwright (tests/e2e/chromium.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from tests.e2e import chromium  # noqa: F401 - skips this module without Chromium and Playwright
from tests.stack import Stack

QUESTION = "what colour is it?"
MAX_TOKENS = 12
SCREENSHOT = Path("/tmp/epd_web_demo_reasoning.png")
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = build_checkpoint(
        tmp_path_factory.mktemp("demo_reasoning") / "qwen3_5", TinyVLMSpec(family="qwen3_5")
    )
    extra = {"gateway": ["--reasoning-parser", "qwen3"]}
    with Stack(model, tmp_path_factory.mktemp("logs_demo_reasoning"), extra=extra, http=True) as s:
        s.http_url = f"http://127.0.0.1:{s.http_port}/"
        s.model_dir = model
        yield s


@pytest.fixture
def page(browser, stack, media_files):
    with chromium.checked_page(browser, TIMEOUT_MS) as page:
        page.bodies = []  # type: ignore[attr-defined]  # the answer requests' bodies, in order
        page.on(
            "request",
            lambda r: (
                page.bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None
            ),  # type: ignore[attr-defined]
        )
        page.goto(stack.http_url)
        page.fill("#max-tokens", str(MAX_TOKENS))
        page.set_input_files("#file-input", str(media_files["png"]))
        page.wait_for_function("() => document.querySelectorAll('#frames .frame img').length === 1")
        yield page


def _answer_of(page, extra: dict) -> dict:
    """The non-streamed answer to the body the page would send for QUESTION now, with `extra`."""
    return page.evaluate(
        """async ([question, extra]) => {
            const body = {model: "", max_tokens: parseInt($("max-tokens").value, 10), media: mediaOptions(),
                          messages: conversationMessages(question), ...extra};
            const response = await fetch("/v1/chat/completions",
                                         {method: "POST", headers: apiHeaders(), body: JSON.stringify(body)});
            return await response.json();
        }""",
        [QUESTION, extra],
    )


def _add_to_requests(page, extra: dict) -> None:
    """The page's answer requests go out with `extra` in their bodies."""
    page.evaluate(
        """(extra) => {
            const realFetch = window.fetch;
            window.fetch = (url, options) => url === "/v1/chat/completions"
                ? realFetch(url, {...options, body: JSON.stringify({...JSON.parse(options.body), ...extra})})
                : realFetch(url, options);
        }""",
        extra,
    )


def _ask(page, question: str) -> None:
    page.fill("#question", question)
    page.click("#ask")
    page.wait_for_function("() => !state.busy")
    assert page.is_hidden("#error"), page.text_content("#error")


def _thinking_answer(page, end_id: int) -> tuple[list[int], dict]:
    """(allowed ids, the page's body's answer) of the first pair of ordinary tokens whose greedy
    answer, with `</think>` allowed beside them, holds it after reasoning and before content."""
    for first in range(40, 300, 7):
        allowed = [first, first + 1, end_id]
        reply = _answer_of(page, {"allowed_token_ids": allowed})
        ids = reply["epd"]["token_ids"]
        if end_id in ids and 0 < ids.index(end_id) < len(ids) - 1:
            return allowed, reply
    raise AssertionError("no pair of tokens made an answer with </think> inside it")


def test_the_reasoning_streams_into_a_thinking_block_above_the_answer(page, stack):
    tokenizer = AutoTokenizer.from_pretrained(str(stack.model_dir))
    allowed, reply = _thinking_answer(page, tokenizer.convert_tokens_to_ids("</think>"))
    message = reply["choices"][0]["message"]
    assert message["reasoning"] and message["content"]
    _add_to_requests(page, {"allowed_token_ids": allowed})
    page.evaluate(
        """() => {
            window.__thinkingUpdates = 0;
            new MutationObserver((records) => {
                if (records.some((r) => r.target.closest && r.target.closest(".thinking-text")))
                    window.__thinkingUpdates += 1;
            }).observe(document.getElementById("answers"), {subtree: true, childList: true});
        }"""
    )
    _ask(page, QUESTION)

    card = page.locator("#answers .answer").first
    thinking = card.locator(".thinking")
    assert thinking.is_visible() and card.locator(".thinking summary").text_content() == "Thinking"
    assert card.locator(".thinking-text").text_content() == message["reasoning"]
    assert card.locator(".answer-text").text_content() == message["content"]
    # Above the answer; collapsed once the answer began (a click opens it again).
    assert card.evaluate("c => c.querySelector('.thinking').nextElementSibling.className").startswith(
        "answer-text"
    )
    assert not thinking.evaluate("d => d.open")
    card.locator(".thinking summary").click()
    assert thinking.evaluate("d => d.open") and card.locator(".thinking-text").is_visible()
    assert page.evaluate("window.__thinkingUpdates") >= 1  # filled as its chunks came
    assert card.locator(".token-prob").count() == 0  # no logprobs asked
    page.locator("#chat-panel").screenshot(path=str(SCREENSHOT))

    # The conversation keeps the content alone, as vLLM's clients send an answer back.
    assert page.evaluate("state.turns") == [{"question": QUESTION, "answer": message["content"]}]
    _ask(page, "and then?")
    assert page.bodies[-1]["messages"][1] == {"role": "assistant", "content": message["content"]}  # type: ignore[attr-defined]
    assert "logprobs" not in page.bodies[-1]  # type: ignore[attr-defined]


def test_token_probabilities_shade_each_piece_and_list_the_alternatives(page):
    # The page's request, whole (greedy: the same tokens): its logprobs are what the pieces show.
    reply = _answer_of(page, {"logprobs": True, "top_logprobs": 5})
    page.check("#show-probs")
    _ask(page, QUESTION)
    body = page.bodies[-1]  # type: ignore[attr-defined]
    assert (body["logprobs"], body["top_logprobs"]) == (True, 5)

    message = reply["choices"][0]["message"]
    tokens = reply["choices"][0]["logprobs"]["content"]
    card = page.locator("#answers .answer").first
    pieces = card.locator(".token-prob").evaluate_all(
        "spans => spans.map(s => ({text: s.textContent, logprob: Number(s.dataset.logprob), title: s.title,"
        " colour: s.style.backgroundColor}))"
    )
    assert pieces, "no piece was shaded"
    assert "".join(p["text"] for p in pieces) == (message["reasoning"] or "") + (message["content"] or "")
    first = tokens[0]
    assert math.isclose(pieces[0]["logprob"], first["logprob"], abs_tol=1e-6)
    line = pieces[0]["title"].splitlines()[0]
    assert line.startswith(
        f"{json.dumps(first['token'], ensure_ascii=False)}: {100 * math.exp(first['logprob']):.1f}%"
    )
    assert line.count("%") == 1 + 5  # the token's probability, then its 5 most likely alternatives
    assert all(p["logprob"] <= 0 and p["colour"].startswith("rgb(") for p in pieces)
    card.locator(".token-prob").first.hover()
    page.locator("#chat-panel").screenshot(path=str(SCREENSHOT.with_name("epd_web_demo_probabilities.png")))
