"""Property-based tests (Hypothesis) of VALID requests against one real stack: where
test_fuzz_front_doors.py throws junk (and so mostly tests refusals), these strategies build
/v1/chat/completions, /v1/completions and /v1/responses bodies from random combinations of the
options epd supports (docs/from-vllm.md's request fields: n, max_tokens / max_completion_tokens,
greedy and seeded sampling, top_p, top_k, min_p, the penalties, logit_bias, allowed_token_ids,
bad_words, stop strings and stop_token_ids, ignore_eos, min_tokens, logprobs, prompt_logprobs, echo,
return_token_ids, structured outputs, tools, streaming with its usage options, text alone or with
the test video or image as a data: URL, several turns, cache_salt, priority), or with one field out
of its range (a 400 naming the problem). Properties of every answer:

- a 200's body (each streamed chunk or event) validates as the OpenAI python client's model
  (`ChatCompletion`, `ChatCompletionChunk`, `Completion`, `Response` and its stream events);
- usage adds up: completion tokens are the choices' generated tokens (their `token_ids`, their
  logprobs entries), prompt tokens the prompt's ids, total their sum; n choices indexed 0..n-1;
- each choice has at most max_tokens tokens, at least min_tokens (unless the length stopped it
  first), "length" only at max_tokens and "stop" / "tool_calls" whenever fewer; no stop string in
  the text (but at its end with include_stop_str_in_output);
- logprobs: one entry per token, `top_logprobs` of the asked length, the sampled token first
  (vLLM's order) and the others in falling order; a greedy answer's sampled token is the most
  likely one when nothing but the model's logits picked it;
- a greedy or seeded request streamed and not gives the same text, token ids, logprobs' tokens,
  tool calls and finish reasons, and the same logprob values within `LOGPROB_ABS_TOL` (top tokens
  exactly, but for the order of near-ties: `same_tops`);
- a stop string in the text of the first min_tokens tokens does not end the answer (vLLM's
  detokenizer order; the min_tokens logits mask covers stop token ids only);
- a request with one field out of range is a 400 whose JSON error has a message; nothing is 5xx;
- afterwards the stack is healthy.

Seeded (derandomize) and small so the default suite stays fast; for a long campaign raise the
number of examples (per endpoint), and with EPD_FUZZ_RANDOM=1 draw new ones each run:
EPD_FUZZ_EXAMPLES=1000 EPD_FUZZ_RANDOM=1 pytest tests/integration/test_valid_request_properties.py"""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.stack import Stack

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MAX_EXAMPLES = int(os.environ.get("EPD_FUZZ_EXAMPLES", "12"))
"""Examples per endpoint (three endpoints): the default keeps the module within about a minute."""
VALID = settings(
    max_examples=MAX_EXAMPLES, derandomize=not os.environ.get("EPD_FUZZ_RANDOM"), deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
MAX_LOGPROBS = 20  # the server's --max-logprobs (its default, vLLM's)
TOKEN_IDS = st.integers(0, 299)  # inside the tiny model's vocabulary (512)
PROMPT_IDS = TOKEN_IDS.filter(lambda i: i not in (5, 6))
"""A prompt's token ids: not the image and video placeholders, which only chat's media parts put
in a prompt (a completion's are a 400)."""
STREAM_EVENTS = TypeAdapter(ResponseStreamEvent)
EOS_TOKEN_ID = 2  # the tiny model's <|im_end|>, its generation config's only end-of-sequence id
Entry = tuple[str, float, tuple[tuple[str, float], ...]]
"""One generated token's logprobs as the properties compare them: (token, logprob, its top
((token, logprob), ...), the sampled token first, then the most likely falling: vLLM's order)."""
LOGPROB_ABS_TOL = 1e-4
"""How far a logprob (float32) may be between a request streamed and the same request whole. The
two are not computed alike: the second one's prompt comes from prefill's prefix cache (its prefill
runs over the last token alone, summing in another order), and each decode step batches with
whatever runs beside it (padding, other rows' lengths). Measured over the three endpoints'
properties (docs/benchmarks.md, "Logprobs streamed and whole"): at most 1.4e-5 over 3,831 values
that differed at all; 1e-4 leaves room. Where two top
tokens' logprobs are that close (a near-tie, within twice this), their order may differ: compared
as a set (`same_tops`)."""


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """Tool calls on ("auto" needs the flags) and priority scheduling, so every option can be asked."""
    priority = ["--scheduling-policy", "priority"]
    extra = {
        "gateway": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        "encoder": priority,
        "prefill": priority,
        "decode": priority,
    }
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_valid"), extra=extra, http=True) as s:
        yield s


MEDIA = {"video": "<the test video's data: URL>", "image": "<the test image's data: URL>"}
"""What a body holds where the test media's data: URL goes (`post` puts it in)."""


@pytest.fixture(scope="module")
def media_urls(media_files) -> dict[str, str]:
    return {
        "video": "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode(),
        "image": "data:image/png;base64," + base64.b64encode(media_files["png"].read_bytes()).decode(),
    }


# --- posting, and reading a stream ---


@dataclass
class Answer:
    status: int
    body: Any
    """The JSON answer; for a 200 stream, each event's data in order ([DONE] left out)."""


def post(port: int, path: str, body: dict, media_urls: dict[str, str] | None = None) -> Answer:
    """POST `body`, its media placeholders (`MEDIA`) replaced by `media_urls`' data: URLs (kept out
    of the bodies Hypothesis shows)."""
    data = json.dumps(body)
    for kind, url in (media_urls or {}).items():
        data = data.replace(json.dumps(MEDIA[kind]), json.dumps(url))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data.encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            raw, status, kind = reply.read(), reply.status, reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        raw, status, kind = exc.read(), exc.code, exc.headers.get("Content-Type", "")
    if "text/event-stream" not in kind:
        return Answer(status, json.loads(raw))
    data = [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]
    if path != RESPONSES:  # chat's and completions' streams end with [DONE]; Responses' with its last event
        assert data and data[-1] == b"[DONE]", raw[-500:]
        data = data[:-1]
    return Answer(status, [json.loads(d) for d in data])


def check_refusal(answer: Answer, body: dict) -> None:
    assert answer.status == 400, (answer.status, answer.body, body)
    assert isinstance(answer.body["error"]["message"], str) and answer.body["error"]["message"], answer.body


# --- strategies: the options a request may carry ---

WORDS = st.sampled_from(
    ["a", "e", "o", " ", "the", "red", "ab", "x", "ing", ".", "\n", "re", "in", "the red", "{"]
)
TEXT = st.lists(st.sampled_from(["what", "is", "the", "red", "square", "doing", "?", "say", "hi"]), min_size=1,
                max_size=8).map(" ".join)  # fmt: skip
GREEDY = {"temperature": 0.0}


@st.composite
def sampling(draw) -> dict[str, Any]:
    """Greedy (temperature 0 or left out) or sampled with a seed, and the sampling filters."""
    out: dict[str, Any] = {}
    kind = draw(st.sampled_from(["unset", "greedy", "sampled"]))
    if kind == "greedy":
        out["temperature"] = 0.0
    elif kind == "sampled":
        out["temperature"] = draw(st.floats(0.1, 2.0))
        out["seed"] = draw(st.integers(0, 2**63 - 1))
        if draw(st.booleans()):
            out["top_p"] = draw(st.floats(0.05, 1.0))
        if draw(st.booleans()):
            out["top_k"] = draw(st.integers(-1, 50))
        if draw(st.booleans()):
            out["min_p"] = draw(st.floats(0.0, 0.5))
    return out


@st.composite
def shaping(draw) -> dict[str, Any]:
    """Options that change which tokens may come: penalties, biases, allowed and banned tokens."""
    out: dict[str, Any] = {}
    for name, value in (  # allowed_token_ids last: not with bad_words, which may ban all of them
        ("presence_penalty", st.floats(-2.0, 2.0)),
        ("frequency_penalty", st.floats(-2.0, 2.0)),
        ("repetition_penalty", st.floats(0.5, 2.0)),
        ("logit_bias", st.dictionaries(TOKEN_IDS.map(str), st.floats(-100, 100), min_size=1, max_size=3)),
        ("bad_words", st.lists(st.sampled_from(["red", "the", "a", "square"]), min_size=1, max_size=2)),
        ("allowed_token_ids", st.lists(TOKEN_IDS, min_size=1, max_size=20, unique=True)),
    ):
        if draw(st.integers(0, 5)) == 0 and not (name == "allowed_token_ids" and "bad_words" in out):
            out[name] = draw(value)
    return out


@st.composite
def ending(draw, max_tokens: int, allowed: bool = False) -> dict[str, Any]:
    """What ends an answer: stop strings and ids, ignore_eos, min_tokens (at most max_tokens; not
    with `allowed` token ids, which the end-of-sequence and stop ids it holds back may be)."""
    out: dict[str, Any] = {}
    if draw(st.integers(0, 2)) == 0:
        out["stop"] = draw(st.one_of(WORDS, st.lists(WORDS, min_size=1, max_size=3)))
        if draw(st.booleans()):
            out["include_stop_str_in_output"] = True
    if draw(st.integers(0, 3)) == 0:
        out["stop_token_ids"] = draw(st.lists(TOKEN_IDS, min_size=1, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        out["ignore_eos"] = True
    if draw(st.integers(0, 3)) == 0 and not allowed:
        out["min_tokens"] = draw(st.integers(0, max_tokens))
    return out


VIDEO_SAMPLING = st.one_of(
    st.fixed_dictionaries({"num_frames": st.integers(2, 4)}),
    st.fixed_dictionaries({"fps": st.sampled_from([0.5, 1.0, 2.0]), "max_frames": st.integers(2, 4)},
                          optional={"start_time_s": st.sampled_from([0.0, 1.5]), "end_time_s": st.sampled_from([4.0, 8.0])}),
)  # fmt: skip
"""The `media` frame sampling of a request with the test video (8 s): a few frames, so it stays fast."""
DECODING = st.fixed_dictionaries({}, optional={"skip_special_tokens": st.booleans(),
                                               "spaces_between_special_tokens": st.booleans()})  # fmt: skip
STRUCTURED = st.sampled_from([
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}},
    {"response_format": {"type": "text"}},
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"structured_outputs": {"regex": "[a-z]{1,6}"}},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "red square"'}},
    {"structured_outputs": {"json": {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}},
                                     "required": ["c"]}}},
])  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_colour", "description": "the square's colour",
        "parameters": {"type": "object", "properties": {"where": {"type": "string"}}}}}  # fmt: skip
TOOL_CHOICES = st.sampled_from(
    ["none", "auto", "required", {"type": "function", "function": {"name": "get_colour"}}]
)


CONFLICTING = {"allowed_token_ids", "bad_words", "min_tokens"}
"""Options that may leave a structured-output constraint (a response_format, a required or named
tool call) no token to take: a 400 saying so, not an answer (not drawn together)."""


@st.composite
def common(draw, max_tokens: int, streamable: bool = True) -> dict[str, Any]:
    """The options chat and completions share (not logprobs: each door has its own form)."""
    body: dict[str, Any] = {**draw(sampling()), **draw(shaping()), **draw(DECODING)}
    body.update(draw(ending(max_tokens, "allowed_token_ids" in body)))
    if draw(st.integers(0, 3)) == 0:
        body["n"] = draw(st.integers(2, 3))
    if draw(st.integers(0, 3)) == 0 and not CONFLICTING & set(body):
        body.update(draw(STRUCTURED))
    if draw(st.booleans()):
        body["return_token_ids"] = True
    if draw(st.integers(0, 4)) == 0:
        body["cache_salt"] = draw(st.sampled_from(["tenant-a", "tenant-b"]))
    if draw(st.integers(0, 4)) == 0:
        body["priority"] = draw(st.integers(-10, 10))
    if streamable and draw(st.booleans()):
        body["stream"] = True
        options = draw(st.sampled_from([None, {"include_usage": True},
                                        {"include_usage": True, "continuous_usage_stats": True}]))  # fmt: skip
        if options is not None:
            body["stream_options"] = options
    elif draw(st.integers(0, 3)) == 0:
        body["prompt_logprobs"] = draw(st.integers(0, 3))
    return body


MAX_TOKENS = st.one_of(st.integers(1, 8), st.integers(9, 32))
"""Mostly short answers (the tiny model is fast, but two cores are shared), some longer ones, where
stop strings are held back and matched across steps."""


def max_tokens_field(draw) -> tuple[str, int]:
    return draw(st.sampled_from(["max_tokens", "max_completion_tokens"])), draw(MAX_TOKENS)


OUT_OF_RANGE = {
    "max_tokens": st.sampled_from([0, -1, 4097]), "max_completion_tokens": st.sampled_from([0, 4097]),
    "temperature": st.sampled_from([-0.5, "nan"]), "top_p": st.sampled_from([0.0, 1.5, -1]),
    "top_k": st.sampled_from([-2, 2**31]), "min_p": st.sampled_from([-0.1, 1.5]),
    "presence_penalty": st.sampled_from([2.5, -3]), "frequency_penalty": st.sampled_from([2.01, -2.5]),
    "repetition_penalty": st.sampled_from([0, -1]), "n": st.sampled_from([0, 17]),
    "logit_bias": st.sampled_from([{"1": 101}, {"-1": 1}, {"x": 1}, {"100000000": 1}]),
    "allowed_token_ids": st.sampled_from([[], [-1], [100000000]]), "stop_token_ids": st.sampled_from([[-1], [100000000]]),
    "min_tokens": st.just(-1), "seed": st.just(2**64), "priority": st.just(2**40),
    "stop": st.sampled_from([[""], ["a"] * 33]), "prompt_logprobs": st.sampled_from([-1, MAX_LOGPROBS + 1]),
}  # fmt: skip
"""One field at a time out of its range (docs/from-vllm.md, README's bounds): a 400."""


def spoil(draw, body: dict[str, Any], chat: bool = False) -> str | None:
    """One time in six, one field of `body` set out of range: its name, else None. `chat`: its
    `top_logprobs` too (above --max-logprobs)."""
    if draw(st.integers(0, 5)):
        return None
    name = draw(st.sampled_from(sorted(OUT_OF_RANGE) + (["top_logprobs"] if chat else [])))
    if name == "top_logprobs":
        body.update(logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
        return name
    body[name] = draw(OUT_OF_RANGE[name])
    if name in ("max_tokens", "max_completion_tokens"):  # max_completion_tokens wins over max_tokens
        body.pop("max_completion_tokens" if name == "max_tokens" else "max_tokens", None)
    if name == "max_tokens" and body[name] == 0:  # a completion's echo of the prompt alone (vLLM's)
        body.pop("echo", None)
    if name == "prompt_logprobs":
        body.pop("stream", None), body.pop("stream_options", None)
    return name


# --- chat ---


@st.composite
def chat_bodies(draw) -> tuple[dict[str, Any], str | None]:
    """(a chat body, the field spoilt or None)."""
    media = draw(st.sampled_from([None, None, "video", "image"]))
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    for _ in range(draw(st.integers(0, 2))):
        messages += [{"role": "user", "content": draw(TEXT)}, {"role": "assistant", "content": draw(TEXT)}]
    content: Any = draw(TEXT)
    if media is not None:
        part = {"type": f"{media}_url", f"{media}_url": {"url": MEDIA[media]}}
        content = (
            [part, {"type": "text", "text": content}]
            if draw(st.booleans())
            else [{"type": "text", "text": content}, part]
        )
    messages.append({"role": "user", "content": content})
    name, max_tokens = max_tokens_field(draw)
    body: dict[str, Any] = {"messages": messages, name: max_tokens, **draw(common(max_tokens))}
    if media == "video":
        body["media"] = draw(VIDEO_SAMPLING)
    if draw(st.integers(0, 2)) == 0:
        body["logprobs"] = True
        if draw(st.booleans()):
            body["top_logprobs"] = draw(st.integers(0, 5))
    if draw(st.integers(0, 3)) == 0 and "response_format" not in body and "structured_outputs" not in body:
        body["tools"] = [TOOL]
        body["tool_choice"] = draw(
            TOOL_CHOICES if not CONFLICTING & set(body) else st.sampled_from(["none", "auto"])
        )
    if draw(st.integers(0, 5)) == 0:
        body["echo"] = True
    if (
        draw(st.integers(0, 5)) == 0
    ):  # the answer goes on from an assistant message's start (echoed with echo)
        messages.append({"role": "assistant", "content": draw(TEXT)})
        body.update(add_generation_prompt=False, continue_final_message=True)
    return body, spoil(draw, body, chat=True)


def test_chat_completions(stack, media_urls):
    @VALID
    @given(case=chat_bodies())
    def run(case: tuple[dict[str, Any], str | None]) -> None:
        ask(stack.http_port, CHAT, case, media_urls)

    run()


def ask(port: int, path: str, case: tuple[dict[str, Any], str | None], media_urls: dict[str, str]) -> None:
    """Post a chat or completions `case`: a spoilt one is refused; a valid one's answer is
    checked, and a reproducible one's is the same asked the other way (streamed or not)."""
    body, spoilt = case
    answer = post(port, path, body, media_urls)
    if spoilt is not None:
        return check_refusal(answer, body)
    first = answered(path, body, answer)
    if reproducible(body):
        second = answered(path, flipped(body), post(port, path, flipped(body), media_urls))
        same_answer(body, first, second)


def token_counts(usage: dict | None) -> tuple[int, int] | None:
    return None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])


def same_answer(body: dict, first: Answered, second: Answered) -> None:
    """The same choices (their logprobs within LOGPROB_ABS_TOL), and the same prompt and
    completion tokens where both say them."""
    assert first[0] == second[0], (body, first[0], second[0])
    for a, b in zip(first[0], second[0], strict=True):
        same_logprobs(body, a.logprobs, b.logprobs)
    if first[1] is not None and second[1] is not None:
        assert first[1] == second[1], (body, first[1], second[1])


def close(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= LOGPROB_ABS_TOL  # == for -inf (a token no rule lets through)


def same_logprobs(body: dict, a: tuple[Entry, ...] | None, b: tuple[Entry, ...] | None) -> None:
    """The same request's logprobs streamed and whole (their tokens are compared exactly before):
    each token's logprob within LOGPROB_ABS_TOL, its top tokens as `same_tops` says."""
    if a is None or b is None:  # not asked, or not told apart from an echo's prompt tokens
        return
    assert len(a) == len(b), (body, a, b)
    for (token, logprob_a, tops_a), (_, logprob_b, tops_b) in zip(a, b, strict=True):
        assert close(logprob_a, logprob_b), (token, logprob_a, logprob_b, body)
        same_tops(tops_a, tops_b, logprob_a, body)


def same_tops(
    a: tuple[tuple[str, float], ...], b: tuple[tuple[str, float], ...], sampled: float, body: dict
) -> None:
    """Top tokens (the sampled token first, then the most likely falling) streamed and whole: the
    same tokens, their logprobs within LOGPROB_ABS_TOL, but at near-ties. Tokens whose logprobs are
    within twice the tolerance may come in either order (compared as a set), and the last of them
    may trade places with the first not shown; a completion's dict (k + 1 long when the sampled
    token is not among the k most likely) may be one shorter in one when the sampled token ties
    with the k-th. A completion's tops holding "\ufffd" (pieces of one character, one entry for
    several tokens) are not compared."""
    if any("\ufffd" in t for t, _ in (*a, *b)):
        return
    assert len(a) == len(b) == 0 or (a[0][0] == b[0][0] and close(a[0][1], b[0][1])), (a, b, body)
    rest_a, rest_b = list(a[1:]), list(b[1:])
    if len(rest_a) != len(rest_b):
        longer = rest_a if len(rest_a) > len(rest_b) else rest_b
        tied = longer[-1][1] - sampled <= 2 * LOGPROB_ABS_TOL
        assert abs(len(rest_a) - len(rest_b)) == 1 and tied, (a, b, body)
        rest_a, rest_b = rest_a[: len(rest_b)], rest_b[: len(rest_a)]
    for (_, value_a), (_, value_b) in zip(rest_a, rest_b, strict=True):
        assert close(value_a, value_b), (a, b, body)
    n = len(rest_a)
    if n == 0:
        return
    apart = [
        i for i in range(1, n) if all(r[i - 1][1] - r[i][1] > 2 * LOGPROB_ABS_TOL for r in (rest_a, rest_b))
    ]
    for lo, hi in zip([0, *apart], [*apart, n], strict=True):
        group_a, group_b = rest_a[lo:hi], rest_b[lo:hi]
        if hi < n:
            assert sorted(t for t, _ in group_a) == sorted(t for t, _ in group_b), (a, b, body)
        else:  # the last group: those tied with the first token not shown may differ
            edge = min(group_a[-1][1], group_b[-1][1]) + 3 * LOGPROB_ABS_TOL
            assert {t for t, v in group_a if v > edge} <= {t for t, _ in group_b}, (a, b, body)
            assert {t for t, v in group_b if v > edge} <= {t for t, _ in group_a}, (a, b, body)


@dataclass(frozen=True)
class Choice:
    """One choice as the properties compare it, whole or streamed."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: tuple[int, ...] | None
    logprob_tokens: tuple[str, ...] | None
    tool_calls: tuple[tuple[str, str], ...]
    logprobs: tuple[Entry, ...] | None = field(default=None, compare=False)
    """Each token's logprob and top tokens (when asked): compared within LOGPROB_ABS_TOL
    (`same_logprobs`), not exactly."""


Answered = tuple[list[Choice], tuple[int, int] | None]
"""An answer's choices and its (prompt, completion) token counts, where it says them."""


def greedy(body: dict) -> bool:
    return body.get("temperature", 0.0) == 0.0


def reproducible(body: dict) -> bool:
    """Greedy or seeded: asked again (streamed if it was not, or not if it was), the same answer
    (vLLM's seeded sampling is per request, whatever else runs beside it). Not with prompt_logprobs,
    which a stream does not take."""
    return (greedy(body) or "seed" in body) and "prompt_logprobs" not in body


def flipped(body: dict) -> dict:
    """`body` streamed if it was not, and not if it was (usage asked for in the stream)."""
    if body.get("stream"):
        return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def max_tokens_of(body: dict) -> int:
    return body["max_completion_tokens"] if "max_completion_tokens" in body else body["max_tokens"]


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def check_choice(body: dict, choice: Choice, count: int | None) -> None:
    """The length, finish reason and stop-string properties of one choice of `count` tokens; a
    chat echo's text starts with the final assistant message it continues (vLLM's)."""
    max_tokens = max_tokens_of(body)
    if body.get("echo") and body.get("continue_final_message") and not choice.tool_calls:
        assert choice.text.startswith(body["messages"][-1]["content"]), (choice, body)
    if count is not None:
        assert 1 <= count <= max_tokens or (count == 0 and choice.finish_reason == "stop"), (count, body)
        if choice.finish_reason == "length":
            assert count == max_tokens, (count, choice, body)
        if count < max_tokens:
            assert choice.finish_reason in ("stop", "tool_calls"), (count, choice, body)
        assert count >= min(body.get("min_tokens", 0), max_tokens), (count, choice, body)
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    if choice.token_ids is not None:  # each request's own token rules, whatever else was batched with it
        if "allowed_token_ids" in body:
            assert set(choice.token_ids) <= set(body["allowed_token_ids"]), (choice, body)
        ending = set(body.get("stop_token_ids", ())) | (set() if body.get("ignore_eos") else {EOS_TOKEN_ID})
        assert not ending & set(choice.token_ids[:-1]), (choice, body)
    if choice.finish_reason == "stop" and not choice.tool_calls and not body.get("echo"):
        check_structured(body, choice.text)
    # vLLM's detokenizer looks for stop strings only once more than min_tokens tokens are in, and
    # only where they end in the text those later tokens add: the first ones' text may hold one.
    # An echo's prompt text is not looked at.
    for stop in stop_strings(body) if not body.get("min_tokens") and not body.get("echo") else ():
        if body.get("include_stop_str_in_output") and choice.text.endswith(stop):
            assert stop not in choice.text[: -len(stop)], (stop, choice, body)
        else:
            assert stop not in choice.text, (stop, choice, body)


def check_structured(body: dict, text: str) -> None:
    """An answer the end-of-sequence token ended keeps to its structured-output constraint whole
    (a stop string or stop token may cut it first: not looked at then)."""
    if stop_strings(body) or body.get("stop_token_ids"):
        return
    spec = body.get("structured_outputs") or {}
    kind = (body.get("response_format") or (body.get("text") or {}).get("format") or {}).get("type")
    if kind in ("json_object", "json_schema") or "json" in spec:
        value = json.loads(text)
        assert isinstance(value, dict), text
        if kind == "json_schema":
            assert isinstance(value["x"], int), text
        if "json" in spec:
            assert value["c"] in ("red", "blue"), text
    elif "choice" in spec:
        assert text in spec["choice"], text
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    elif "grammar" in spec:
        assert text in ("yes", "no", "red square"), text


def check_usage(body: dict, usage: dict, prompt_ids: list[int] | None, counts: list[int | None]) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    if prompt_ids is not None:
        assert usage["prompt_tokens"] == len(prompt_ids), (usage, len(prompt_ids))
    if all(c is not None for c in counts):
        assert usage["completion_tokens"] == sum(c for c in counts if c is not None), (usage, counts, body)


def check_top_logprobs(body: dict, k: int, entries: list[Entry], one_more: bool = False) -> None:
    """Each position's (token, logprob, [(token, logprob)] tops): k of them, the sampled token first
    and the others falling; greedy with nothing but the logits choosing, the sampled is the best.
    `one_more`: a completion's dict, k + 1 long when the sampled token is not among the k most
    likely (vLLM's); keyed by the tokens' text, so tokens of the same text (pieces of one
    character, "\ufffd") are one entry holding the later one's logprob (vLLM's dict too): only
    its length's bound holds then."""
    plain = not {"logit_bias", "allowed_token_ids", "bad_words", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "response_format", "structured_outputs", "min_tokens", "tools"} & set(body)  # fmt: skip
    for token, logprob, tops in entries:
        if one_more and any("\ufffd" in t for t, _ in tops):
            assert len(tops) <= k + 1 and token in dict(tops), (k, token, tops)
            continue
        assert len(tops) == k or (one_more and len(tops) == k + 1), (k, tops)
        if tops:
            assert tops[0] == (token, logprob), (token, logprob, tops)
            assert all(a[1] >= b[1] for a, b in zip(tops[1:], tops[2:], strict=False)), tops
            if greedy(body) and plain and not body.get("ignore_eos"):
                assert all(logprob >= other for _, other in tops), (token, logprob, tops)


def chat_choices(body: dict, answer: dict) -> Answered:
    ChatCompletion.model_validate(answer)
    n = body.get("n", 1)
    assert [c["index"] for c in answer["choices"]] == list(range(n)), answer["choices"]
    choices, counts = [], []
    for c in answer["choices"]:
        message = c["message"]
        ids = c.get("token_ids")
        assert (ids is not None) == bool(body.get("return_token_ids")), c
        content = (c.get("logprobs") or {}).get("content")
        assert (content is not None) == bool(body.get("logprobs")), c
        if ids is not None and content is not None:
            assert len(ids) == len(content), (ids, content)
        count = len(ids) if ids is not None else len(content) if content is not None else None
        entries = None if content is None else chat_entries(content)
        if entries is not None:
            check_top_logprobs(body, body.get("top_logprobs", 0), entries)
        calls = tuple(
            (t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls") or ()
        )
        choice = Choice(c["index"], message.get("content") or "", c["finish_reason"], tuple(ids) if ids else ids,
                        tuple(e[0] for e in entries) if entries is not None else None, calls,
                        tuple(entries) if entries is not None else None)  # fmt: skip
        check_choice(body, choice, count)
        choices.append(choice)
        counts.append(count)
    prompt_ids = answer.get("prompt_token_ids")
    assert (prompt_ids is not None) == bool(body.get("return_token_ids")), answer.keys()
    check_usage(body, answer["usage"], prompt_ids, counts)
    if body.get("prompt_logprobs") is not None:
        assert answer["prompt_logprobs"][0] is None, answer["prompt_logprobs"][:2]
        assert len(answer["prompt_logprobs"]) == answer["usage"]["prompt_tokens"], answer["usage"]
        check_prompt_logprobs(body["prompt_logprobs"], answer["prompt_logprobs"])
    return choices, token_counts(answer["usage"])


def chat_entries(content: list[dict]) -> list[Entry]:
    """Chat's (and the Responses API's) logprobs entries."""
    return [(e["token"], e["logprob"], tuple((t["token"], t["logprob"]) for t in e["top_logprobs"]))
            for e in content]  # fmt: skip


def check_prompt_logprobs(k: int, entries: list[dict[str, dict] | None]) -> None:
    """vLLM's prompt_logprobs: per token after the first, the prompt token first, then the k most
    likely (k + 1 entries when the prompt token is not among them): ranks 1..k, their logprobs
    falling with the rank."""
    for entry in entries[1:]:
        assert entry is not None
        values = list(entry.values())
        first, ranks = values[0]["rank"], sorted(v["rank"] for v in values)
        if first > k:
            assert ranks[:-1] == list(range(1, k + 1)) and ranks[-1] == first, (k, entry)
        else:
            assert ranks == list(range(1, k + 1)), (k, entry)
        by_rank = sorted(values, key=lambda v: v["rank"])
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(by_rank, by_rank[1:], strict=False)), entry


def stream_steps(
    body: dict, chunks: list[dict], validate: Callable[[dict], Any], parts: dict[int, dict[str, Any]]
) -> Iterator[tuple[dict, dict, dict]]:
    """Each (chunk, choice, the choice's `parts` so far) of a chat or completions stream, each
    chunk validated, after the checks both share: usage where asked (on every chunk with
    continuous_usage_stats, counting the choice's tokens so far, vLLM's; else a last chunk of
    usage alone), nothing after a choice's finish, its token ids gathered (`parts[i]["ids"]`) and
    its finish reason (`"finish"`) read. The usage chunk's usage goes in `parts[-1]`."""
    usage_asked = (body.get("stream_options") or {}).get("include_usage")
    continuous = usage_asked and body["stream_options"].get("continuous_usage_stats")
    for chunk in chunks:
        validate(chunk)
        if not chunk["choices"]:  # the usage chunk, last
            assert usage_asked and -1 not in parts, chunk
            parts[-1] = chunk["usage"]
            continue
        assert ("usage" in chunk) == bool(continuous), chunk
        if continuous:  # the same prompt on every chunk
            assert chunk["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"], chunk
        for c in chunk["choices"]:
            part = parts[c["index"]]
            if continuous and body.get("return_token_ids"):
                so_far = len(part["ids"]) + len(c.get("token_ids") or ())
                assert chunk["usage"]["completion_tokens"] == so_far, (chunk, so_far)
            assert part["finish"] is None, ("a chunk after the choice's finish", chunk)
            part["ids"] += c.get("token_ids") or []
            yield chunk, c, part
            part["finish"] = c.get("finish_reason")
    assert (-1 in parts) == bool(usage_asked), chunks[-1:]


def chat_stream_choices(body: dict, chunks: list[dict]) -> Answered:
    """The choices the chunks add up to, each chunk checked on the way."""
    parts: dict[int, dict[str, Any]] = {
        i: {"text": "", "ids": [], "entries": [], "finish": None, "calls": {}, "prompt_ids": None}
        for i in range(body.get("n", 1))
    }
    for chunk, c, part in stream_steps(body, chunks, ChatCompletionChunk.model_validate, parts):
        delta = c["delta"]
        part["text"] += delta.get("content") or ""
        part["prompt_ids"] = part["prompt_ids"] or chunk.get("prompt_token_ids")  # vLLM's: the chunk's
        entries = chat_entries((c.get("logprobs") or {}).get("content") or [])
        part["entries"] += entries
        check_top_logprobs(body, body.get("top_logprobs", 0), entries)
        for call in delta.get("tool_calls") or ():
            name, arguments = part["calls"].get(call["index"], ("", ""))
            function = call.get("function") or {}
            part["calls"][call["index"]] = (
                name + (function.get("name") or ""),
                arguments + (function.get("arguments") or ""),
            )
    return streamed_choices(body, parts, lambda part: part["entries"] if body.get("logprobs") else None)


def streamed_choices(
    body: dict, parts: dict[int, dict[str, Any]], logprobs: Callable[[dict], list[Entry] | None]
) -> Answered:
    """The `Choice`s of a stream's `parts` (`stream_steps`), each checked, and the usage chunk's
    usage; `logprobs`: a part's generated tokens' logprobs entries, None when not asked."""
    choices, counts = [], []
    for i in range(body.get("n", 1)):
        part = parts[i]
        ids = tuple(part["ids"]) if body.get("return_token_ids") else None
        entries = logprobs(part)
        count = len(ids) if ids is not None else len(entries) if entries is not None else None
        choice = Choice(i, part["text"], part["finish"], ids,
                        tuple(e[0] for e in entries) if entries is not None else None,
                        tuple(part["calls"][k] for k in sorted(part.get("calls", ()))),
                        tuple(entries) if entries is not None else None)  # fmt: skip
        check_choice(body, choice, count)
        if body.get("return_token_ids"):
            assert part["prompt_ids"] is not None, ("no prompt_token_ids for choice", i)
        choices.append(choice)
        counts.append(count)
    if -1 in parts:
        check_usage(body, parts[-1], parts[0]["prompt_ids"], counts)
    return choices, token_counts(parts.get(-1))


# --- legacy completions ---


@st.composite
def completion_bodies(draw) -> tuple[dict[str, Any], str | None]:
    prompt: Any = draw(st.one_of(TEXT, st.lists(PROMPT_IDS, min_size=1, max_size=12)))
    name, max_tokens = max_tokens_field(draw)
    if name == "max_completion_tokens":  # completions have max_tokens alone
        name = "max_tokens"
    body: dict[str, Any] = {"prompt": prompt, name: max_tokens, **draw(common(max_tokens))}
    if draw(st.integers(0, 2)) == 0:
        body["logprobs"] = draw(st.integers(0, 5))
    if draw(st.integers(0, 4)) == 0:
        body["echo"] = True
    return body, spoil(draw, body)


def test_completions(stack):
    @VALID
    @given(case=completion_bodies())
    def run(case: tuple[dict[str, Any], str | None]) -> None:
        ask(stack.http_port, COMPLETIONS, case, {})

    run()


@st.composite
def min_tokens_bodies(draw) -> tuple[dict[str, Any], int]:
    """A greedy completion that runs to max_tokens (ignore_eos; no stop token ids) with its token
    ids, and a min_tokens below max_tokens."""
    max_tokens = draw(st.integers(3, 16))
    prompt = draw(st.one_of(TEXT, st.lists(PROMPT_IDS, min_size=1, max_size=12)))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **draw(DECODING)}  # fmt: skip
    return body, draw(st.integers(2, max_tokens - 1))


def test_a_stop_string_in_the_first_min_tokens_does_not_end_the_answer(stack):
    """vLLM's order (epd/model_runtime/detokenizer.py): stop strings are looked for only once more
    than min_tokens tokens are in, and only where they end in the text those later tokens add;
    min_tokens' logits mask covers the stop token ids alone, so a detokenizer that looked in the
    first min_tokens tokens' text ended the answer there. The stop string is a piece of that text
    (the same greedy request cut at min_tokens tokens first), so such a detokenizer finds it: the
    answer must still start with those tokens, and a stop string end it only after them."""

    @VALID
    @given(case=min_tokens_bodies(), data=st.data())
    def run(case: tuple[dict[str, Any], int], data: st.DataObject) -> None:
        body, min_tokens = case
        # Cut at min_tokens, with the same min_tokens: its mask holds the end-of-sequence token
        # back even under ignore_eos (vLLM's `_all_stop_token_ids`), so these are the same tokens.
        early = post(
            stack.http_port, COMPLETIONS, {**body, "max_tokens": min_tokens, "min_tokens": min_tokens}
        )
        assert early.status == 200, (early.status, early.body, body)
        early_ids = early.body["choices"][0]["token_ids"]
        text = early.body["choices"][0]["text"].split("\ufffd")[0]  # whole characters only
        if not text:
            return
        start = data.draw(st.integers(0, len(text) - 1), label="stop string's start")
        stop = text[start : data.draw(st.integers(start + 1, min(start + 4, len(text))), label="its end")]
        asked = {**body, "min_tokens": min_tokens, "stop": [stop]}
        answer = post(stack.http_port, COMPLETIONS, asked)
        assert answer.status == 200, (answer.status, answer.body, asked)
        choice = answer.body["choices"][0]
        assert choice["token_ids"][:min_tokens] == early_ids, (choice, early_ids, asked)
        if choice["finish_reason"] == "stop":
            assert len(choice["token_ids"]) > min_tokens, (choice, asked)

    run()


def completion_logprob_entries(logprobs: dict) -> list[Entry]:
    return [(t, lp, tuple((top or {}).items())) for t, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"],
                                                              logprobs["top_logprobs"], strict=True)]  # fmt: skip


def validate_completion(answer: dict, chunk: bool = False) -> None:
    """`Completion.model_validate`, but for an echoed prompt's first token's null logprob (vLLM's
    `CompletionLogProbs` holds `float | None`; OpenAI's client model takes floats alone) and, in a
    `chunk`, a null finish_reason (the client reads stream chunks as `Completion`s, which it has no
    chunk model for, without validating them)."""
    copy = json.loads(json.dumps(answer))
    for choice in copy["choices"]:
        if chunk and choice["finish_reason"] is None:
            choice["finish_reason"] = "stop"
        logprobs = choice.get("logprobs")
        if logprobs and logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                del logprobs[key][0]
    Completion.model_validate(copy)


def completion_choices(body: dict, answer: dict) -> Answered:
    validate_completion(answer)
    n = body.get("n", 1)
    assert [c["index"] for c in answer["choices"]] == list(range(n)), answer["choices"]
    choices, counts = [], []
    prompt_ids = None
    for c in answer["choices"]:
        ids = c.get("token_ids")
        assert (ids is not None) == bool(body.get("return_token_ids")), c
        prompt_ids = c.get("prompt_token_ids")
        logprobs = c.get("logprobs")
        assert (logprobs is not None) == ("logprobs" in body), c
        tokens = entries = None
        if logprobs is not None:
            entries = completion_logprob_entries(logprobs)
            if body.get("echo"):  # the prompt's tokens first (the first with nulls)
                entries = entries[len(prompt_ids) :] if prompt_ids is not None else None
            if entries is not None:
                check_top_logprobs(body, body["logprobs"], entries, one_more=True)
                tokens = tuple(t for t, _, _ in entries)
        count = len(ids) if ids is not None else len(tokens) if tokens is not None else None
        choice = Choice(c["index"], c["text"], c["finish_reason"], tuple(ids) if ids is not None else None, tokens,
                        (), tuple(entries) if entries is not None else None)  # fmt: skip
        check_choice(body, choice, count)
        choices.append(choice)
        counts.append(count)
    check_usage(body, answer["usage"], prompt_ids, counts)
    if body.get("prompt_logprobs") is not None:  # each choice's, vLLM's: null for the first token
        for c in answer["choices"]:
            assert c["prompt_logprobs"][0] is None, c["prompt_logprobs"][:2]
            assert len(c["prompt_logprobs"]) == answer["usage"]["prompt_tokens"], answer["usage"]
            check_prompt_logprobs(body["prompt_logprobs"], c["prompt_logprobs"])
    return choices, token_counts(answer["usage"])


def completion_stream_choices(body: dict, chunks: list[dict]) -> Answered:
    parts: dict[int, dict[str, Any]] = {
        i: {"text": "", "ids": [], "entries": [], "finish": None, "prompt_ids": None}
        for i in range(body.get("n", 1))
    }
    for _, c, part in stream_steps(body, chunks, lambda chunk: validate_completion(chunk, chunk=True), parts):
        part["text"] += c["text"]
        part["prompt_ids"] = part["prompt_ids"] or c.get("prompt_token_ids")
        if c.get("logprobs"):
            part["entries"] += completion_logprob_entries(c["logprobs"])

    def logprobs(part: dict) -> list[Entry] | None:
        """The generated tokens' (an echo's prompt tokens come first)."""
        if "logprobs" not in body or (body.get("echo") and part["prompt_ids"] is None):
            return None
        return part["entries"][len(part["prompt_ids"]) :] if body.get("echo") else part["entries"]

    return streamed_choices(body, parts, logprobs)


# --- several at once ---


def answered(path: str, body: dict, answer: Answer) -> Answered:
    """A 200 chat or completions answer (whole or streamed), checked."""
    assert answer.status == 200, (answer.status, answer.body, body)
    stream, whole = (
        (chat_stream_choices, chat_choices)
        if path == CHAT
        else (completion_stream_choices, completion_choices)
    )
    return stream(body, answer.body) if body.get("stream") else whole(body, answer.body)


def test_side_by_side(stack, media_urls):
    """Two to four valid chat and completions requests at once, so that the stages batch them:
    each answer keeps its own request's options (lengths, stop and allowed tokens, n, logprobs' k,
    usage) whatever ran beside it. Half as many examples as each endpoint's test."""
    valid = st.tuples(st.just(CHAT), chat_bodies()) | st.tuples(st.just(COMPLETIONS), completion_bodies())

    @settings(VALID, max_examples=max(MAX_EXAMPLES // 2, 3))
    @given(calls=st.lists(valid.filter(lambda call: call[1][1] is None), min_size=2, max_size=4))
    def run(calls: list[tuple[str, tuple[dict[str, Any], str | None]]]) -> None:
        with ThreadPoolExecutor(len(calls)) as pool:
            answers = list(
                pool.map(lambda call: post(stack.http_port, call[0], call[1][0], media_urls), calls)
            )
        for (path, (body, _)), answer in zip(calls, answers, strict=True):
            answered(path, body, answer)

    run()


# --- the Responses API ---

RESPONSES_TOOL = {"type": "function", "name": "get_colour", "description": "the square's colour",
                  "parameters": {"type": "object", "properties": {"where": {"type": "string"}}}}  # fmt: skip


@st.composite
def responses_bodies(draw) -> tuple[dict[str, Any], str | None]:
    media = draw(st.sampled_from([None, None, "video", "image"]))
    if media is None and draw(st.booleans()):
        body: dict[str, Any] = {"input": draw(TEXT)}
    else:
        items: list[dict[str, Any]] = []
        for _ in range(draw(st.integers(0, 1))):
            items += [{"role": "user", "content": draw(TEXT)},
                      {"role": "assistant", "content": [{"type": "output_text", "text": draw(TEXT)}]}]  # fmt: skip
        parts: list[dict[str, Any]] = [{"type": "input_text", "text": draw(TEXT)}]
        if media == "image":
            parts.append({"type": "input_image", "image_url": MEDIA["image"]})
        elif media == "video":
            parts.append({"type": "video_url", "video_url": {"url": MEDIA["video"]}})
        items.append({"type": "message", "role": "user", "content": parts})
        body = {"input": items}
    if media == "video":
        body["media"] = draw(VIDEO_SAMPLING)
    max_tokens = draw(MAX_TOKENS)
    body["max_output_tokens"] = max_tokens
    if draw(st.booleans()):
        body["instructions"] = draw(TEXT)
    body.update(draw(sampling()))
    body.update(draw(shaping()))
    body.update(draw(ending(max_tokens, "allowed_token_ids" in body)))
    free = not CONFLICTING & set(body)
    if draw(st.integers(0, 3)) == 0 and free:
        body["text"] = {"format": draw(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
            "type": "json_schema", "name": "a", "schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                           "required": ["x"]}}]))}  # fmt: skip
    elif draw(st.integers(0, 3)) == 0:
        body["tools"] = [RESPONSES_TOOL]
        choices = ["none", "auto", "required", {"type": "function", "name": "get_colour"}]
        body["tool_choice"] = draw(st.sampled_from(choices if free else choices[:2]))
    if draw(st.integers(0, 2)) == 0:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["stream"] = True
    spoilt = None
    if not draw(st.integers(0, 5)):
        spoilt = draw(st.sampled_from(sorted(set(OUT_OF_RANGE) - {"n", "max_tokens", "max_completion_tokens",
                                                                   "prompt_logprobs"}) + ["max_output_tokens"]))  # fmt: skip
        body[spoilt] = draw(
            OUT_OF_RANGE["max_tokens"] if spoilt == "max_output_tokens" else OUT_OF_RANGE[spoilt]
        )
    return body, spoilt


def test_responses(stack, media_urls):
    @VALID
    @given(case=responses_bodies())
    def run(case: tuple[dict[str, Any], str | None]) -> None:
        body, spoilt = case
        answer = post(stack.http_port, RESPONSES, body, media_urls)
        if spoilt is not None:
            return check_refusal(answer, body)
        assert answer.status == 200, (answer.status, answer.body, body)
        if body.get("stream"):
            final = responses_stream(body, answer.body)
        else:
            final = answer.body
        whole, logprobs = response_summary(body, final)
        if reproducible(body):
            other = post(stack.http_port, RESPONSES, {**body, "stream": not body.get("stream")}, media_urls)
            assert other.status == 200, (other.status, other.body, body)
            other_final = responses_stream(body, other.body) if not body.get("stream") else other.body
            other_whole, other_logprobs = response_summary(body, other_final)
            assert whole == other_whole, (body, final, other_final)
            same_logprobs(body, logprobs, other_logprobs)

    run()


def responses_stream(body: dict, events: list[dict]) -> dict:
    """The final response of a stream, each event validated on the way; the text deltas add up to
    the final message's text."""
    deltas = ""
    for event in events:
        STREAM_EVENTS.validate_python(event)  # usage's cache_write_tokens required: epd writes it
        if event["type"] == "response.output_text.delta":
            deltas += event["delta"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    final = events[-1]["response"]
    assert deltas == output_text(final), (deltas, final)
    return final


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")  # fmt: skip


def response_summary(body: dict, response: dict) -> tuple[tuple, tuple[Entry, ...] | None]:
    """Check a (final) response; what a greedy answer streamed and not must share, exactly, and its
    logprobs entries (None when not asked), which it must share within LOGPROB_ABS_TOL."""
    Response.model_validate(response)
    usage = response["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage
    max_tokens = body["max_output_tokens"]
    assert usage["output_tokens"] <= max_tokens, (usage, body)
    assert usage["output_tokens"] >= min(body.get("min_tokens", 0), max_tokens), (usage, body)
    incomplete = response.get("incomplete_details")
    if response["status"] == "incomplete":
        assert incomplete["reason"] == "max_output_tokens" and usage["output_tokens"] == max_tokens, response
    else:
        assert response["status"] == "completed", response
    text = output_text(response)
    if stop_strings(body) and not body.get("include_stop_str_in_output") and not body.get("min_tokens"):
        assert not any(stop in text for stop in stop_strings(body)), (text, body)
    calls = tuple(
        (item["name"], item["arguments"]) for item in response["output"] if item["type"] == "function_call"
    )
    if response["status"] == "completed" and not calls:
        check_structured(body, text)
    logprobs = entries = None
    if body.get("include") and not calls:
        entries = tuple(chat_entries([lp for item in response["output"] if item["type"] == "message"
                                      for part in item["content"] if part["type"] == "output_text"
                                      for lp in part.get("logprobs") or ()]))  # fmt: skip
        check_top_logprobs(body, body["top_logprobs"], list(entries))
        logprobs = tuple(e[0] for e in entries)
        if text:
            assert len(entries) == usage["output_tokens"], (entries, usage)
    return (text, calls, response["status"], usage["input_tokens"], usage["output_tokens"], logprobs), entries


def test_healthy_after(stack):
    assert stack.alive()
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/health", timeout=30) as reply:
        assert reply.status == 200 and json.loads(reply.read()) == {"status": "ok"}
    answer = post(stack.http_port, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status == 200 and answer.body["choices"][0]["finish_reason"] in ("stop", "length")
