"""A request's structured output compiles while its media is encoded, through real processes: the
gateway asks the prefill replica the request's prefill goes to (CompileStructuredOutputs) as soon
as it admits the request. A spec that does not compile is refused before the encode has finished,
and that encode is cancelled (a slow video's: no "encode finished" event reaches the client, the
encoder logs the cancel); a request that shares the media's encode gets its answer all the same; a
good spec's answer is token for token the masked reference; past MAX_ABANDONED_COMPILES slow
compiles still running, a new spec is a 429 with Retry-After, end to end."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epd.client import EpdClient
from epd.client.types import EpdError, StageEvent
from epd.model_runtime.structured_output import MAX_ABANDONED_COMPILES
from tests.integration.structured_cases import (
    CASES,
    NUM_FRAMES,
    QUESTION,
    SLOW_REGEX,
    chat,
    chat_request,
    masked_references,
)
from tests.reference import decode_for_test
from tests.stack import QUICK_CLOSE, VerboseStack, wait_until

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    deadline = ["--structured-compile-timeout-s", str(TIMEOUT_S), *QUICK_CLOSE]
    extra = {"prefill": deadline, "decode": deadline}
    with VerboseStack(
        tiny_models["qwen2_vl"],
        tmp_path_factory.mktemp("logs_early_compile"),
        extra=extra,
        http=True,
    ) as s:
        yield s


def salt() -> str:
    """A tenant of its own: the encoder's token cache (keyed by it too) has nothing of it, so the
    request's media is decoded and encoded, not served from the cache."""
    return uuid.uuid4().hex


def test_a_spec_that_does_not_compile_is_refused_before_its_encode_finishes(stack, long_clip):
    request_id = uuid.uuid4().hex
    events: list[StageEvent] = []
    with EpdClient(stack.gateway, timeout_s=120) as client:
        with pytest.raises(EpdError) as caught:
            for event in client.stream(long_clip, QUESTION, num_frames=256, max_frames=256, structured_outputs={"regex": "[a-"},
                                       cache_salt=salt(), request_id=request_id):  # fmt: skip
                events.append(event)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "the structured-output regex does not compile: Regex parsing error" in caught.value.message
        finished = [e.stage for e in events if isinstance(e, StageEvent) and e.state == "finished"]
        assert "encode" not in finished and "prefill" not in finished, events
    log = stack.log_dir / "encoder.log"
    wait_until(
        lambda: f"encode of request {request_id} cancelled by its caller" in log.read_text(), "the cancel"
    )


def test_a_good_specs_answer_is_the_masked_reference_and_a_refused_one_beside_it_disturbs_nothing(
    stack, tiny_models, media_files
):
    """Sent at once about the same media, new to the encoder: a refused spec's request cancels its
    encode, and the other (which may be waiting for that very encode: the encoder's single
    flight) still gets its answer, token for token the reference."""
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    want = masked_references(tiny_models["qwen2_vl"], video, ["json_schema"])
    tenant = salt()
    asks = [CASES["json_schema"][0], {"guided_regex": "[a-"}, {}]
    with ThreadPoolExecutor(len(asks)) as pool:
        replies = list(
            pool.map(lambda fields: chat(stack.http_port, media_files, cache_salt=tenant, **fields), asks)
        )
    (good_status, good), (bad_status, bad), (plain_status, plain) = replies
    assert good_status == 200 and good["choices"][0]["token_ids"] == want["json_schema"], good
    assert bad_status == 400 and "regex does not compile" in bad["error"]["message"], bad
    assert plain_status == 200 and plain["choices"][0]["token_ids"] == want["plain"], plain


def test_past_the_bound_on_slow_compiles_a_new_spec_is_a_429_with_retry_after(stack, media_files):
    known = {"guided_regex": "(red|blue) (circle|square) known"}
    status, body = chat(stack.http_port, media_files, **known)
    assert status == 200, body
    # Each slow spec runs past TIMEOUT_S and is left compiling (about 2.7 s on a quiet core), so
    # after MAX_ABANDONED_COMPILES of them the next new spec is refused at once. On a busy machine
    # one may finish before the next request comes (seen: two sent at once, one delayed by its
    # gateway), so slow specs are sent until the refusal comes, a few past the bound at most.
    for i in range(MAX_ABANDONED_COMPILES + 4):
        # a suffix makes each a spec of its own, compiled anew
        status, body, headers = chat_with_headers(
            stack.http_port, media_files, guided_regex=f"{SLOW_REGEX}z{i}"
        )
        if status == 429:
            break
        assert status == 400, body
        assert f"regex took longer than {TIMEOUT_S:g} s to compile" in body["error"]["message"]
    assert status == 429, body
    assert i >= MAX_ABANDONED_COMPILES  # not before the bound
    assert "too many slow structured-output specs are still compiling" in body["error"]["message"]
    assert int(headers["Retry-After"]) > 0
    status, body = chat(stack.http_port, media_files, **known)  # compiled before: served
    assert status == 200, body


def chat_with_headers(port: int, media_files, **fields) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(chat_request(port, media_files, **fields), timeout=120) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)
