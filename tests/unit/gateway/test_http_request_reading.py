"""What the HTTP front doors make of a request before the pipeline has it (in-process server, real
sockets, a pipeline that records the request): a data URL decoded and hashed off the event loop, a
local file's bytes held on the request's ticket, the request id a body or a header names, and
int, float and bool fields read as vLLM's pydantic models read them."""

from __future__ import annotations

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.pipeline import Pipeline
from tests.unit.gateway.scripted_http import _post_chat, _ScriptedPipeline


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
