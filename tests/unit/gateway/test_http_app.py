"""The HTTP layer alone (in-process server, real sockets): body limit, API key, JSON errors for
aiohttp's own refusals, and /health. None of these requests reaches the pipeline."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline
from epd.stages.errors import Busy
from epd.stages.model_info import ModelInfo

UPLOAD_LIMIT_BYTES = 1000
JSON = {"Content-Type": "application/json"}


async def _not_serving_decode() -> list[str]:
    return ["decode"]


async def _requests(api_key: str, fn, not_serving=None):
    config = GatewayConfig(
        max_upload_bytes=UPLOAD_LIMIT_BYTES,
        http=HttpApiConfig(port=0, api_keys=(api_key,) if api_key else ()),
    )
    metrics = GatewayMetrics()
    api = HttpApi(config, Pipeline(None, None, None), metrics, not_serving)  # type: ignore[arg-type]
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            return await fn(session), metrics
    finally:
        await runner.cleanup()


async def _status_and_json(resp: aiohttp.ClientResponse):
    return resp.status, await resp.json()


def test_body_over_the_limit_is_413_json():
    async def post_big(session):
        # The limit is max_upload_bytes * 4/3 (base64) + 1 MiB of JSON.
        async with session.post("/v1/chat/completions", data=b"x" * ((1 << 20) + 2000), headers=JSON) as resp:
            return await _status_and_json(resp)

    (status, body), metrics = asyncio.run(_requests("", post_big))
    assert status == 413
    assert body["error"]["type"] == "request_too_large"
    assert body["error"]["code"] == 413  # vLLM's: the HTTP status as an integer (it was null)
    assert metrics.value("epd_http_responses_total", route="/v1/chat/completions", code="413") == 1


def test_api_key_guards_v1_only():
    async def calls(session):
        out = []
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer k1"}):
            async with session.get("/v1/models", headers=headers) as resp:
                out.append(resp.status)
        async with session.get("/metrics") as resp:
            out.append(resp.status)
            assert "epd_http_responses_total" in await resp.text()
        return out

    statuses, _ = asyncio.run(_requests("k1", calls))
    assert statuses == [401, 401, 200, 200]


def test_api_key_answers_401_before_404_where_vllm_does():
    """vLLM's AuthenticationMiddleware guards /v1, /v2, /inference, /cohere and the prefixes of the
    routes it registers (/invocations, /tokenize) before routing: a client without the key learns
    nothing of what is served there. A path vLLM has only for pooling models, or in its dev mode,
    is a 404 there and here."""
    keyed = [
        "/v1/embeddings",
        "/v1/load_lora_adapter",
        "/v2/models",
        "/inference/v1/generate",
        "/invocations",
    ]
    keyed += ["/cohere/v2/chat", "/v1", "/tokenize"]
    open_ = ["/pooling", "/classify", "/score", "/rerank", "/sleep", "/reset_prefix_cache"]

    async def calls(session):
        out = {}
        for path in keyed + open_:
            async with session.post(path, json={}) as resp:
                out[path] = resp.status
        async with session.post("/invocations", json={}, headers={"Authorization": "Bearer k1"}) as resp:
            out["keyed /invocations"] = resp.status
        return out

    statuses, _ = asyncio.run(_requests("k1", calls))
    assert statuses == {**dict.fromkeys(keyed, 401), **dict.fromkeys(open_, 404), "keyed /invocations": 404}


def test_unknown_route_and_bad_json_are_json_errors():
    async def calls(session):
        async with session.get("/v2/nothing") as resp:
            missing = await _status_and_json(resp)
        async with session.post("/v1/chat/completions", data=b"{not json", headers=JSON) as resp:
            bad = await _status_and_json(resp)
        return missing, bad

    (missing, bad), _ = asyncio.run(_requests("", calls))
    assert missing[0] == 404 and "error" in missing[1]
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"] and bad[1]["error"]["code"] == 400


def test_a_body_not_sent_as_json_is_415_before_it_is_read():
    """Any Content-Type was read as JSON (vLLM refuses all but application/json): text/plain, form
    and multipart bodies are those a page of another site may POST without a CORS preflight, from
    a browser too old to send the Sec-Fetch-Site header the browser guard reads."""
    body = b'{"messages": []}'
    content_types = [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        None,
        "application/json; charset=utf-8",
        "Application/JSON",
    ]

    async def calls(session):
        out = []
        for content_type in content_types:
            headers = {"Content-Type": content_type} if content_type else {}
            for path in ("/v1/chat/completions", "/demo/frames"):
                # aiohttp adds application/octet-stream to bytes unless told to skip the header.
                async with session.post(
                    path,
                    data=body,
                    headers=headers,
                    skip_auto_headers=() if content_type else ("Content-Type",),
                ) as resp:
                    out.append((path, content_type, resp.status, (await resp.json())["error"]["message"]))
        return out

    results, metrics = asyncio.run(_requests("", calls))
    for path, content_type, status, message in results:
        if content_type in ("application/json; charset=utf-8", "Application/JSON"):
            # read: a bad body
            assert status == 400 and "Content-Type" not in message, (path, content_type, message)
        else:
            assert status == 415, (path, content_type, status)
            assert "must be JSON sent with 'Content-Type: application/json'" in message
            assert (
                f"got Content-Type '{content_type}'" if content_type else "got no Content-Type"
            ) in message
    assert metrics.value("epd_http_responses_total", route="/v1/chat/completions", code="415") == 5


def test_health_names_the_stages_not_serving():
    async def health(session):
        async with session.get("/health") as resp:
            return await _status_and_json(resp)

    (status, body), _ = asyncio.run(_requests("k1", health, _not_serving_decode))
    assert (status, body) == (503, {"status": "unavailable", "not_serving": ["decode"]})
    (status, body), _ = asyncio.run(_requests("k1", health))
    assert (status, body) == (200, {"status": "ok"})


def test_ping_is_health_and_version_names_epds_as_vllm_serves_them_without_a_key():
    """vLLM's /ping (SageMaker's probe, GET and POST) and /version were 404s."""
    from importlib.metadata import version

    async def calls(session):
        out = []
        for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/version")):
            async with session.request(method, path) as resp:
                out.append(await _status_and_json(resp))
        return out

    down, _ = asyncio.run(_requests("k1", calls, _not_serving_decode))
    assert down[:2] == [(503, {"status": "unavailable", "not_serving": ["decode"]})] * 2
    up, _ = asyncio.run(_requests("k1", calls))
    assert up == [(200, {"status": "ok"})] * 2 + [(200, {"version": version("epd")})]


def test_retrieve_model_names_the_served_model_or_404():
    async def calls(session):
        out = []
        for path in ("/v1/models/epd", "/v1/models/other", "/v1/models/org/name"):
            async with session.get(path) as resp:
                out.append(await _status_and_json(resp))
        return out

    (served, other, slashed), _ = asyncio.run(_requests("", calls))
    assert served[0] == 200 and served[1]["id"] == "epd" and served[1]["object"] == "model"
    # vLLM's ModelCard fields: root (its weights' path there, the served name here), parent, permission
    card = served[1]
    assert (card["root"], card["parent"], card["owned_by"]) == ("epd", None, "epd")
    (permission,) = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {k: v for k, v in permission.items() if k not in ("id", "object", "created")} == {
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    assert other[0] == 404 and "model 'other' is not served here" in other[1]["error"]["message"]
    assert slashed[0] == 404 and "model 'org/name'" in slashed[1]["error"]["message"]


def _post_chat(
    pipeline: Pipeline,
    body: dict,
    config: GatewayConfig | None = None,
    admission=None,
    headers: dict | None = None,
    answer_headers: dict | None = None,
    path: str = "/v1/chat/completions",
) -> str:
    """POST `body` to `path` (chat completions) of an in-process API over `pipeline`; the answer's
    text (and its headers into `answer_headers`)."""

    async def run():
        api = HttpApi(
            config or GatewayConfig(http=HttpApiConfig(port=0)),
            pipeline,
            GatewayMetrics(),
            admission=admission,
        )
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                async with session.post(path, json=body, headers=headers) as resp:
                    if answer_headers is not None:
                        answer_headers.update((k.lower(), v) for k, v in resp.headers.items())
                    return (await resp.read()).decode()
        finally:
            await runner.cleanup()

    return asyncio.run(run())


class _Recorded(Exception):
    """Ends the fake pipeline's run once it has the request."""


class _RecordingPipeline(Pipeline):
    """Hands each request to `record`, then ends its run (`_Recorded`: the client gets a 500)."""

    def __init__(self, record) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.record = record

    async def ask(self, req):  # type: ignore[override]
        self.record(req)
        raise _Recorded("recorded")
        yield


def test_a_data_url_is_decoded_and_hashed_off_the_event_loop(monkeypatch):
    """Both ran on the event loop: a 64 MB upload held every other client's stream (and both APIs)
    still for over a second."""
    import base64
    import hashlib
    import threading

    from epd.gateway import http_media, media_fetch

    threads: list[tuple[str, int]] = []
    real_decode, real_hash = media_fetch.decode_data_url, http_media.sha256_hex
    monkeypatch.setattr(
        http_media,
        "decode_data_url",
        lambda *a: threads.append(("decode", threading.get_ident())) or real_decode(*a),
    )
    monkeypatch.setattr(
        http_media, "sha256_hex", lambda d: threads.append(("hash", threading.get_ident())) or real_hash(d)
    )
    asked = []

    media = bytes(range(256))
    url = "data:video/mp4;base64," + base64.b64encode(media).decode()
    content = [{"type": "text", "text": "q"}, {"type": "video_url", "video_url": {"url": url}}]

    recording = _RecordingPipeline(lambda req: asked.append((req, threading.get_ident())))
    _post_chat(recording, {"messages": [{"role": "user", "content": content}]})
    ((req, loop_thread),) = asked
    assert (req.media.data, req.media.sha256) == (media, hashlib.sha256(media).hexdigest())
    assert [name for name, _ in threads] == ["decode", "hash"]
    assert all(thread != loop_thread for _, thread in threads)


def _summary(token_ids: list[int], answer: str, num_prompt_tokens: int):
    from epd.gateway.ask_types import AskSummary

    return AskSummary(
        request_id="r1",
        answer=answer,
        token_ids=token_ids,
        finish_reason="length",
        num_frames=2,
        num_visual_tokens=4,
        num_prompt_tokens=num_prompt_tokens,
        timings_ms={},
        kv_num_bytes=0,
        encoder_cache_hit=False,
        media_sha256="",
        frame_timestamps_s=[],
    )


PROMPT_IDS = [151644, 872, 198]


class _ScriptedPipeline(Pipeline):
    """Answers every request with prefill's event, the prompt's ids when the request asks (as a
    real pipeline, whose prefill sends them then), two tokens and the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import PromptTokenIds
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        asked = req.generation.return_prompt_token_ids
        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        if asked:
            yield PromptTokenIds(PROMPT_IDS)
        yield TokenStep([5], "a")
        yield TokenStep([6, 7], "bc")
        summary = _summary([5, 6, 7], "abc", 30)
        summary.prompt_token_ids = PROMPT_IDS if asked else None
        yield summary


class _BrokenStreamPipeline(Pipeline):
    """One token, then the decode replica is lost: the client already has its 200."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import TokenStep
        from epd.transport.errors import broken_stream

        yield TokenStep([5], "a")
        raise broken_stream("decode", 1, req.request_id)


def test_a_stream_that_ends_in_an_error_event_is_logged_as_failed(caplog):
    """Its log line said `http POST /v1/chat/completions 200` like any answer: the operator could
    not tell the failed streamed answers from the good ones."""
    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "stream": True}
    with caplog.at_level(logging.INFO, logger="epd.gateway.http_api"):
        text = _post_chat(_BrokenStreamPipeline(), body)
        good = _post_chat(_ScriptedPipeline(), body)
    assert '"error"' in text and text.endswith("data: [DONE]\n\n") and '"error"' not in good
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("http POST")]
    assert len(lines) == 2
    assert lines[0].startswith("http POST /v1/chat/completions 200 stream_error=502 "), lines
    assert "stream_error" not in lines[1]


class _SlowPipeline(Pipeline):
    """Its first token (or its error) comes only after `delay_s`, as after a long encode."""

    def __init__(self, delay_s: float, error: Exception | None = None) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.delay_s = delay_s
        self.error = error

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import TokenStep

        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        yield TokenStep([5], "a")
        yield _summary([5], "a", 30)


STREAM_BODY = {"messages": [{"role": "user", "content": [
    {"type": "text", "text": "q"}, {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
]}], "stream": True}  # fmt: skip


def _keepalive_config(keepalive_s: float) -> GatewayConfig:
    return GatewayConfig(http=HttpApiConfig(port=0, sse_keepalive_s=keepalive_s))


def test_a_stream_waiting_for_its_first_token_gets_keep_alive_comments_that_clients_skip():
    """Its 200 came only with the first token: a long encode behind a proxy with an idle timeout
    (nginx: 60 s) was cut before it. Now comment lines come meanwhile, and the OpenAI SDK's own
    SSE parser reads the answer as if they were not there."""
    from openai._streaming import SSEDecoder

    text = _post_chat(_SlowPipeline(0.7), STREAM_BODY, config=_keepalive_config(0.1))
    head, _, rest = text.partition("data: ")
    assert head.count(": keep-alive\n\n") >= 3 and head == ": keep-alive\n\n" * head.count(": keep-alive")
    events = [e for e in SSEDecoder().iter_bytes(iter([text.encode()]))]
    import json

    chunks = [json.loads(e.data) for e in events if e.data != "[DONE]"]
    assert [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]][:2] == ["", "a"]
    assert ": keep-alive" not in _post_chat(_SlowPipeline(0.3), STREAM_BODY, config=_keepalive_config(0))
    assert ": keep-alive" not in _post_chat(_SlowPipeline(0.0), STREAM_BODY, config=_keepalive_config(10))


def test_an_error_before_the_first_token_keeps_its_status_unless_a_keep_alive_went_out():
    """Before any keep-alive the error has its own HTTP status; after one (the 200 is out) it is
    an error event and [DONE], as an error after the first token is."""
    import json

    busy = Busy("the decoder's KV memory is full")
    answer_headers: dict = {}
    text = _post_chat(
        _SlowPipeline(0.0, busy), STREAM_BODY, config=_keepalive_config(10), answer_headers=answer_headers
    )
    assert json.loads(text)["error"]["code"] == 429 and answer_headers["retry-after"] == "1"
    text = _post_chat(_SlowPipeline(0.5, busy), STREAM_BODY, config=_keepalive_config(0.1))
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert text.startswith(": keep-alive") and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 429


def _stream_chunks(stream_options: dict, **fields) -> list:
    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "stream_options": stream_options,
        **fields,
    }

    events = [
        line.removeprefix("data: ") for line in _post_chat(_ScriptedPipeline(), body).split("\n\n") if line
    ]
    assert events[-1] == "[DONE]"
    import json

    return [json.loads(e) for e in events[:-1]]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    """vLLM's `stream_options.continuous_usage_stats` was ignored: every chunk said usage null."""
    chunks = _stream_chunks({"include_usage": True, "continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 3, 3, 3]  # role, a, bc, final, usage
    assert all(
        c["usage"]["prompt_tokens"] == 30
        and c["usage"]["total_tokens"] == 30 + c["usage"]["completion_tokens"]
        for c in chunks
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0
    }
    plain = _stream_chunks({"include_usage": True})  # vLLM's: no usage field but the last chunk's
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 3
    # as vLLM: only with include_usage
    assert all("usage" not in c for c in _stream_chunks({"continuous_usage_stats": True}))
    # vLLM's chat sets completion_tokens_details on every continuous-usage chunk, null without
    # --reasoning-parser (the final usage chunk leaves the nulls out)
    assert all(c["usage"]["completion_tokens_details"] is None for c in chunks[:-1])
    assert "completion_tokens_details" not in chunks[-1]["usage"]


class _TwoChoicePipeline(Pipeline):
    """Answers with two choices: choice 0 one token then two, choice 1 three tokens at once."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        yield TokenStep([5], "a", index=0)
        yield TokenStep([8, 9, 10], "xyz", index=1)
        yield TokenStep([6, 7], "bc", index=0)
        summary = _summary([5, 6, 7], "abc", 30)
        summary.choices = [
            ChoiceSummary(0, "abc", [5, 6, 7], "length"),
            ChoiceSummary(1, "xyz", [8, 9, 10], "length"),
        ]
        yield summary


def test_continuous_usage_counts_each_chunks_own_choice():
    """With n > 1 each chunk's completion_tokens summed every choice's tokens so far (1, 4, 6), where
    vLLM's chat and completions stream count the chunk's own choice (`previous_num_tokens[i]`);
    the final usage chunk sums them, as vLLM's."""
    import json

    body = {
        "messages": [{"role": "user", "content": "q"}],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    text = _post_chat(_TwoChoicePipeline(), body)
    chunks = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    counts = [(c["choices"][0]["index"], c["usage"]["completion_tokens"]) for c in chunks if c["choices"]]
    assert counts == [(0, 0), (1, 0), (0, 1), (1, 3), (0, 3), (0, 3), (1, 3)], counts
    assert all(c["usage"]["total_tokens"] == 30 + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_a_local_files_bytes_are_held_on_the_requests_ticket(tmp_path):
    """They were held outside the body budget: requests naming large files (or URLs) in small
    bodies were never refused for it."""
    from epd.gateway.admission import Admission
    from epd.gateway.config import MediaFetchConfig

    (tmp_path / "clip.mp4").write_bytes(b"v" * 5000)
    config = GatewayConfig(
        http=HttpApiConfig(port=0, media=MediaFetchConfig(allowed_local_dir=str(tmp_path)))
    )
    admission = Admission.of_gateway(config)
    held = []

    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": str(tmp_path / "clip.mp4")}},
    ]
    recording = _RecordingPipeline(lambda req: held.append(admission.num_reserved_bytes))
    _post_chat(recording, {"messages": [{"role": "user", "content": content}]}, config, admission)
    assert len(held) == 1 and held[0] > 5000  # the body's bytes and the file's
    assert admission.num_reserved_bytes == 0


def test_the_request_id_a_body_names_is_the_requests_unless_a_header_names_one():
    """vLLM's body `request_id` (the gRPC API's AskHeader.request_id) was ignored on HTTP."""
    import json

    ids = []

    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "request_id": "body-id-1"}
    out: list[tuple[str, str]] = []
    for headers in ({}, {"x-request-id": "header-id-1"}):
        answer_headers: dict = {}
        recording = _RecordingPipeline(lambda req: ids.append(req.request_id))
        error = json.loads(_post_chat(recording, body, headers=headers, answer_headers=answer_headers))
        out.append((answer_headers["x-request-id"], error["error"]["message"]))
    assert ids == ["body-id-1", "header-id-1"]
    assert out[0][0] == "body-id-1" and out[0][1].endswith("(request id body-id-1)")
    assert out[1][0] == "header-id-1" and out[1][1].endswith("(request id header-id-1)")


def test_a_body_refused_for_one_of_its_fields_is_answered_under_the_id_it_names():
    """The body's `request_id` was adopted only once the whole body had been checked, so the 400
    for a bad field named (and x-request-id carried) an id the client had never seen."""
    import json

    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "request_id": "body-id-2", "temperature": -1}
    answer_headers: dict = {}
    error = json.loads(_post_chat(_ScriptedPipeline(), body, answer_headers=answer_headers))["error"]
    assert "temperature" in error["message"] and error["message"].endswith("(request id body-id-2)"), error
    assert answer_headers["x-request-id"] == "body-id-2"


def test_the_answers_token_ids_are_on_its_choices_only_when_asked_streamed_or_not():
    """vLLM's `return_token_ids`: each choice lists its tokens' ids, whole or streamed (each chunk
    its step's); without it they are null, as vLLM writes them (every streamed chunk had them;
    then the field was left out), the ids only in `epd.token_ids`."""
    import json

    content = [
        {"type": "text", "text": "q"},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    ]
    body = {"messages": [{"role": "user", "content": content}], "return_token_ids": True}
    answer = json.loads(_post_chat(_ScriptedPipeline(), body))
    assert answer["choices"][0]["token_ids"] == [5, 6, 7] == answer["epd"]["token_ids"]
    streamed = _stream_chunks({}, return_token_ids=True)
    assert [t for c in streamed for t in c["choices"][0].get("token_ids") or []] == [5, 6, 7]
    plain = json.loads(_post_chat(_ScriptedPipeline(), {**body, "return_token_ids": False}))
    assert plain["choices"][0]["token_ids"] is None and plain["epd"]["token_ids"] == [5, 6, 7]
    chunks = _stream_chunks({})
    # vLLM's: the role chunk has no token_ids field, every chunk of tokens a null one
    assert "token_ids" not in chunks[0]["choices"][0]
    assert [c["choices"][0]["token_ids"] for c in chunks[1:]] == [None, None, None]


def test_the_prompts_token_ids_are_in_the_answer_only_when_asked_as_vllm_places_them():
    """vLLM's `return_token_ids` gives the prompt's ids too (`prompt_token_ids`), which prefill
    sends the gateway (it has no tokenizer) only when asked: chat's at the answer's top, whole or
    in its role chunk alone; a completion's in its choice, whole or in the choice's first chunk
    (its later chunks' null). Not asked: null where vLLM writes the field."""
    import json

    chat = {"messages": [{"role": "user", "content": "q"}]}
    answer = json.loads(_post_chat(_ScriptedPipeline(), {**chat, "return_token_ids": True}))
    assert answer["prompt_token_ids"] == PROMPT_IDS and "prompt_token_ids" not in answer["choices"][0]
    assert json.loads(_post_chat(_ScriptedPipeline(), chat))["prompt_token_ids"] is None
    chunks = _stream_chunks({}, return_token_ids=True)
    assert (
        chunks[0]["prompt_token_ids"] == PROMPT_IDS
        and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    assert not [c for c in chunks[1:] if "prompt_token_ids" in c]
    chunks = _stream_chunks({})
    assert chunks[0]["prompt_token_ids"] is None and not [c for c in chunks[1:] if "prompt_token_ids" in c]

    completion = {"prompt": "q", "return_token_ids": True}
    text = _post_chat(_ScriptedPipeline(), completion, path="/v1/completions")
    choice = json.loads(text)["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (PROMPT_IDS, [5, 6, 7])
    plain = json.loads(
        _post_chat(_ScriptedPipeline(), {**completion, "return_token_ids": False}, path="/v1/completions")
    )
    assert (plain["choices"][0]["prompt_token_ids"], plain["choices"][0]["token_ids"]) == (None, None)
    for asked in (True, False):
        text = _post_chat(
            _ScriptedPipeline(),
            {**completion, "stream": True, "return_token_ids": asked},
            path="/v1/completions",
        )
        chunks = [
            json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"
        ]
        ids = [c["choices"][0]["prompt_token_ids"] for c in chunks]
        assert ids == [PROMPT_IDS if asked else None] + [None] * (len(chunks) - 1), ids
        assert [c["choices"][0]["token_ids"] for c in chunks] == ([[5], [6, 7], []] if asked else [None] * 3)


class _ModelLoadFailsPipeline(Pipeline):
    """An embedded front door whose model cannot be loaded (`ModelLoadError`)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.model_runtime.loader import ModelLoadError

        raise ModelLoadError("/models/m", "model.safetensors is truncated or corrupt")
        yield


def test_a_model_that_cannot_load_is_a_500_not_the_clients_400_and_its_path_stays_in_the_log(caplog):
    """FAILED_PRECONDITION (gRPC's code for it) was mapped to 400 invalid_request_error, telling the
    client to change a request that nothing in it could fix; vLLM answers 500 for an engine that
    failed. Streamed or not, before any token. The error's own message, which names the model's
    local path, reached the client with it: it goes to the server log now."""
    import json

    body = {**STREAM_BODY, "stream": False}
    for sent in (body, STREAM_BODY):
        caplog.clear()
        error = json.loads(_post_chat(_ModelLoadFailsPipeline(), sent))["error"]
        assert (error["code"], error["type"]) == (500, "server_error"), error
        assert error["message"].startswith("the server cannot load its model; its operator must fix it")
        assert "/models/m" not in error["message"] and "safetensors" not in error["message"]
        assert "cannot load /models/m: model.safetensors is truncated or corrupt" in caplog.text


class _TwoChoicesPipeline(Pipeline):
    """n=2: choice 0 thinks, calls a tool (the tag split across steps) and finishes first; choice 1
    thinks and answers text, finishing with the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.stages.contracts import TokenStep

        call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        steps = [
            (0, "hm</thi"), (1, "ok</think>It is"), (0, "nk><tool"), (0, "_call>" + call[len("<tool_call>") : 30]),
            (1, " sunny."), (0, call[30:] + "\n"),
        ]  # fmt: skip
        for i, (index, text) in enumerate(steps):
            finish = "stop" if i == len(steps) - 1 else ""
            yield TokenStep([5 + i], text, finish_reason=finish, index=index)
        summary = _summary([5, 7, 8, 10], "hm</think>" + call + "\n", 30)
        summary.finish_reason = "stop"
        summary.choices = [
            ChoiceSummary(0, summary.answer, summary.token_ids, "stop"),
            ChoiceSummary(1, "ok</think>It is sunny.", [6, 9], "length"),
        ]
        yield summary


def test_streamed_choices_part_their_own_tool_calls_with_their_own_finish_reasons():
    """n=2 under --reasoning-parser and --tool-call-parser: each choice's content is parsed for calls
    by its own parser state (the reasoning never), a choice that finishes first ends "tool_calls"
    after its calls, the other keeps its own reason; the deltas joined are the whole answer's."""
    import json

    config = GatewayConfig(
        http=HttpApiConfig(
            port=0, reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"
        )
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "q"}], "tools": [tool], "n": 2, "stream": True}
    text = _post_chat(_TwoChoicesPipeline(), body, config)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]].append(choice)
    first, second = by_index[0], by_index[1]
    reasoning = ["".join(c["delta"].get("reasoning") or "" for c in cs) for cs in (first, second)]
    content = ["".join(c["delta"].get("content") or "" for c in cs) for cs in (first, second)]
    calls = [[d for c in cs for d in c["delta"].get("tool_calls", [])] for cs in (first, second)]
    assert (reasoning, content) == (["hm", "ok"], ["", "It is sunny."])
    assert calls[1] == [] and {d["index"] for d in calls[0]} == {0}
    assert calls[0][0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"]["arguments"] for d in calls[0])) == {"city": "Paris"}
    finishes = [[c["finish_reason"] for c in cs if c["finish_reason"]] for cs in (first, second)]
    assert finishes == [["tool_calls"], ["length"]]
    # vLLM's hermes sets content on each step it says something in (null beside calls; its empty
    # tool_calls beside text left out, vLLM PR #44105); the reasoning's steps carry neither
    hermes = [c["delta"] for cs in (first, second) for c in cs if "role" not in c["delta"]]
    said = [d for d in hermes if "content" in d or "tool_calls" in d]
    assert said and all("content" in d and d.get("tool_calls") != [] for d in said), hermes
    assert [d["content"] for d in said if "tool_calls" in d] == [None]  # choice 0's call, no text
    assert all("tool_calls" not in d for d in hermes if d.keys() == {"reasoning", "reasoning_content"})
    # as the reasoning tokens so far, with continuous usage: each chunk's own choice's
    continuous = _post_chat(
        _TwoChoicesPipeline(),
        {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        config,
    )
    usages = [json.loads(line[6:])["usage"] for line in continuous.splitlines() if line.startswith("data: {")]
    assert [u["completion_tokens_details"]["reasoning_tokens"] for u in usages] == [0, 0, 1, 0, 0, 1, 0, 1]


def _post_each(config: GatewayConfig, pipeline, posts: list[tuple[str, dict, ModelInfo | None]]) -> list[str]:
    """POST each (path, body, model info) in turn to one in-process API over `pipeline` (which
    has an `info`: the model info it reports, set to the post's before it); the answers' texts."""

    async def run() -> list[str]:
        api = HttpApi(config, pipeline, GatewayMetrics())
        runner = web.AppRunner(api.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
                texts = []
                for path, body, info in posts:
                    pipeline.info = info
                    async with session.post(path, json=body) as resp:
                        texts.append((await resp.read()).decode())
                return texts
        finally:
            await runner.cleanup()

    return asyncio.run(run())


class _LateModelInfoPipeline(_TwoChoicesPipeline):
    """`_TwoChoicesPipeline` whose model info (with the think markers' ids: `</think>` is the
    token of choice 0's third step) is known only once `info` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.info: ModelInfo | None = None

    def model_info(self) -> ModelInfo | None:  # type: ignore[override]
        return self.info


def test_without_the_think_markers_ids_reasoning_is_counted_by_its_text_logged_once_until_they_come(caplog):
    """Prefill has not reported the think markers' token ids (here no model info at all): the
    reasoning tokens are counted by where the text falls, and the first answer so counted logs a
    warning saying why, once for the process, not per request. The ids known later (prefill's
    model info came late), the next answer is counted by them: the log is once, the count is not
    stuck on the text."""
    import json

    config = GatewayConfig(http=HttpApiConfig(port=0, reasoning_parser="qwen3"))
    body = {"messages": [{"role": "user", "content": "q"}], "n": 2}
    posts = [("/v1/chat/completions", body, info) for info in (None, None, _THINKING_INFO)]
    with caplog.at_level(logging.WARNING, logger="epd.gateway.http_api"):
        replies = [json.loads(text) for text in _post_each(config, _LateModelInfoPipeline(), posts)]
    # by text: choice 0's "hm</thi" (1 token), then "nk><tool" (1 token, taken for the marker's);
    # choice 1's "ok</think>It is" (1 token, taken for the marker's). By id: choice 0's token 5
    # before `</think>`'s 7; choice 1's 6 and 9 (its "</think>" is text inside token 6, no marker token)
    counts = [r["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in replies]
    assert counts == [1, 1, 1 + 2]
    warnings = [
        r.getMessage() for r in caplog.records if "counting reasoning tokens by where" in r.getMessage()
    ]
    assert len(warnings) == 1 and "token ids of <think> and </think>" in warnings[0]


_THINKING_INFO = ModelInfo(
    1024,
    32768,
    32768,
    4096,
    "qwen3_5",
    reasoning_markers=("<think>", "</think>"),
    reasoning_marker_ids=(99, 7),
)
"""A thinking model's info whose `</think>` is token 7."""


class _ModelInfoAtFirstTokenPipeline(Pipeline):
    """One thinking answer whose model info (the think markers' ids, `_THINKING_INFO`) the gateway
    learns after the request came, before its first token, as prefill's model info comes in the
    background. Its second step carries `</think>` (token 7) with the content's first token, so by
    id one token is reasoning, by where the text falls two (the step's two tokens, one taken for
    the marker's, and the first step's)."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's
        self.info: ModelInfo | None = None

    def model_info(self) -> ModelInfo | None:  # type: ignore[override]
        return self.info

    async def ask(self, req):  # type: ignore[override]
        from epd.stages.contracts import StageEvent, TokenStep
        from epd.stages.names import Stage

        yield StageEvent(Stage.PREFILL, "finished", 1.0, {"num_prompt_tokens": "30"})
        self.info = _THINKING_INFO  # known now: after the stream began, before its first token
        yield TokenStep([5], "a")
        yield TokenStep([7, 8], "</think>b", finish_reason="stop")
        summary = _summary([5, 7, 8], "a</think>b", 30)
        summary.finish_reason = "stop"
        yield summary


def test_an_answer_whose_model_info_comes_before_its_first_token_counts_its_reasoning_by_id(caplog):
    """The think markers' ids were read when a stream began: a stream that began before the
    gateway had prefill's model info was counted by where the text falls to its end, though the
    ids were known by its first token. They are read at the first token now, by the one
    `ReasoningStream` every answer goes through: chat's and the Responses API's, streamed and
    whole, count alike, so only an answer whose ids are still unknown then falls back (and
    nothing is logged here)."""
    import json

    config = GatewayConfig(http=HttpApiConfig(port=0, reasoning_parser="qwen3"))
    chat_body = {"messages": [{"role": "user", "content": "q"}]}
    usage = {"stream_options": {"include_usage": True}}
    # each request comes before the model info, which comes before its first token
    posts = [
        ("/v1/chat/completions", {**chat_body, "stream": True, **usage}, None),
        ("/v1/responses", {"input": "q", "stream": True}, None),
        ("/v1/chat/completions", chat_body, None),
        ("/v1/responses", {"input": "q"}, None),
    ]
    with caplog.at_level(logging.WARNING, logger="epd.gateway.http_api"):
        chat_text, responses_text, chat_whole, responses_whole = _post_each(
            config, _ModelInfoAtFirstTokenPipeline(), posts
        )
    chat = [json.loads(line[6:]) for line in chat_text.splitlines() if line.startswith("data: {")]
    assert "".join(c["delta"].get("reasoning") or "" for ch in chat for c in ch["choices"]) == "a"
    events = [json.loads(line[6:]) for line in responses_text.splitlines() if line.startswith("data: {")]
    (completed,) = [e["response"] for e in events if e["type"] == "response.completed"]
    counts = [
        chat[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"],
        completed["usage"]["output_tokens_details"]["reasoning_tokens"],
        json.loads(chat_whole)["usage"]["completion_tokens_details"]["reasoning_tokens"],
        json.loads(responses_whole)["usage"]["output_tokens_details"]["reasoning_tokens"],
    ]
    assert counts == [1, 1, 1, 1]  # by id: by the text, each 2
    assert "counting reasoning tokens by where" not in caplog.text


class _LogprobsPipeline(Pipeline):
    """Two tokens with their logprobs (the request asked), one step each, then the summary."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]  # no stage: ask is the fake's

    async def ask(self, req):  # type: ignore[override]
        from epd.gateway.ask_types import ChoiceSummary
        from epd.model_runtime.logprobs import TokenLogprob
        from epd.stages.contracts import TokenStep

        lps = [TokenLogprob(5, "a", -0.5), TokenLogprob(6, "b", -0.25)]
        yield TokenStep([5], "a", logprobs=lps[:1])
        yield TokenStep([6], "b", "stop", logprobs=lps[1:])
        summary = _summary([5, 6], "ab", 30)
        summary.finish_reason = "stop"
        summary.choices = [ChoiceSummary(0, "ab", [5, 6], "stop", None, lps)]
        yield summary


def test_include_reasoning_false_hides_the_tokens_logprobs_and_ids_under_either_of_vllms_parsers():
    """vLLM hides every generated token's logprobs and `token_ids` when `include_reasoning` is false
    and its chat serving has a parser (`hide_stream_metadata` / `suppress_metadata`: `parser is not
    None`), which `ParserManager.get_parser` makes for `--reasoning-parser` or for
    `--enable-auto-tool-choice` with `--tool-call-parser`, a tool parser alone too; not for a
    `--tool-call-parser` without `--enable-auto-tool-choice` (no parser), nor with no flag. epd hid
    them only under a reasoning parser. Whole and streamed alike."""
    import json

    body = {"messages": [{"role": "user", "content": "q"}], "include_reasoning": False}
    body |= {"logprobs": True, "return_token_ids": True}
    configs = {
        "no parser": (HttpApiConfig(port=0), False),
        "a tool parser without auto": (HttpApiConfig(port=0, tool_call_parser="hermes"), False),
        "a tool parser": (
            HttpApiConfig(port=0, enable_auto_tool_choice=True, tool_call_parser="hermes"),
            True,
        ),
        "a reasoning parser": (HttpApiConfig(port=0, reasoning_parser="qwen3"), True),
    }
    for name, (http, hidden) in configs.items():
        config = GatewayConfig(http=http)
        choice = json.loads(_post_chat(_LogprobsPipeline(), body, config))["choices"][0]
        whole = (choice["logprobs"], choice.get("token_ids"))
        assert (whole == (None, None)) == hidden, (name, whole)
        text = _post_chat(_LogprobsPipeline(), {**body, "stream": True}, config)
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        streamed = [(c["logprobs"], c.get("token_ids")) for c in choices]
        shown = [s for s in streamed if s != (None, None)]
        assert (shown == []) == hidden, (name, streamed)
        if not hidden:
            assert [ids for _, ids in shown] == [[5], [6]], (name, streamed)


class _RecordingTokenizer(_RecordingPipeline):
    """Hands each /tokenize input to `record`, then ends its call (the client gets a 500)."""

    async def tokenize(self, request, request_id):  # type: ignore[override]
        self.record(request)
        raise _Recorded("recorded")


def test_every_door_reads_int_float_and_bool_fields_as_vllms_pydantic_models_do():
    """vLLM's clients send what its lax pydantic fields take ("0.5", "yes", 1, "2"): chat, legacy
    completions, Responses and /tokenize read them so (float and bool fields were 400s), and a
    value vLLM refuses too is a 400 that names the field."""
    import json

    user = [{"role": "user", "content": "q"}]
    lax = {"temperature": "0.5", "top_p": 1, "seed": "7", "ignore_eos": "yes", "skip_special_tokens": 0,
           "logit_bias": {"5": "-1.5"}}  # fmt: skip
    asked: list = []
    recording = _RecordingPipeline(asked.append)
    _post_chat(recording, {"messages": user, "stream": "false", "max_completion_tokens": "3.0", **lax})
    _post_chat(recording, {"prompt": "q", "echo": "off", "max_tokens": 3, **lax}, path="/v1/completions")
    _post_chat(recording, {"input": "q", "max_output_tokens": "3", "parallel_tool_calls": "f", "store": "no", **lax},
               path="/v1/responses")  # fmt: skip
    tokenized: list = []
    _post_chat(_RecordingTokenizer(tokenized.append), {"prompt": "q", "add_special_tokens": "no",
               "return_token_strs": "on"}, path="/tokenize")  # fmt: skip
    assert len(asked) == 3
    for req in asked:
        g = req.generation
        assert (g.temperature, g.top_p, g.seed, g.max_new_tokens) == (0.5, 1.0, 7, 3)
        assert (g.ignore_eos, g.skip_special_tokens, g.logit_bias) == (True, False, ((5, -1.5),))
    ((tokenize,),) = [tokenized]
    assert (tokenize.prompt, tokenize.add_special_tokens, tokenize.return_token_strs) == ("q", False, True)

    refused = {
        "/v1/chat/completions": (
            {"messages": user, "temperature": "warm"},
            "'temperature' must be a finite number",
        ),
        "/v1/completions": ({"prompt": "q", "echo": "maybe"}, "'echo' must be true or false, got 'maybe'"),
        "/v1/responses": ({"input": "q", "top_p": "nan"}, "'top_p' must be a finite number > 0 and <= 1"),
        "/tokenize": ({"prompt": "q", "return_token_strs": 2}, "'return_token_strs' must be true or false"),
    }
    for path, (sent, message) in refused.items():
        error = json.loads(_post_chat(_ScriptedPipeline(), sent, path=path))
        assert message in error["error"]["message"] and error["error"]["code"] == 400, (path, error)
