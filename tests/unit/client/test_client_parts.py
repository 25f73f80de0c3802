"""The SDK's bookkeeping without a server: retry decisions and backoff, media sources (path,
bytes, seekable and one-shot file objects) and request headers; the gRPC API-key check; the
blocking client's thread and loop when it fails to start or is used after close()."""

from __future__ import annotations

import gc
import hashlib
import io
import json
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epd.client import NO_RETRY, AsyncEpdClient, EpdClient, EpdError, MediaSource, RetryPolicy, build_header
from epd.client.channel import ChannelSettings, channel_credentials, open_channel
from epd.client.client import _call_error, tokenize_request
from epd.transport.auth import bearer_token, key_matches


def test_backoff_grows_then_caps():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.5, max_backoff_s=3.0, multiplier=2.0)
    assert [policy.backoff_s(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_only_unavailable_before_the_first_token_is_retried_and_only_so_often():
    policy = RetryPolicy(max_attempts=3)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=1, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=1, saw_token=True)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, attempt=3, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.INVALID_ARGUMENT, attempt=1, saw_token=False)
    assert not policy.should_retry(grpc.StatusCode.DEADLINE_EXCEEDED, attempt=1, saw_token=False)


def test_resource_exhausted_is_retried_only_when_the_server_said_busy():
    """Listed as retryable, RESOURCE_EXHAUSTED re-sent an upload over the server's limit (HTTP's
    413) as often as a full queue (HTTP's 429); only the latter may succeed later."""
    policy = RetryPolicy(retryable=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert policy.should_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False, busy=True)
    assert not policy.should_retry(grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False)
    assert not RetryPolicy().should_retry(
        grpc.StatusCode.RESOURCE_EXHAUSTED, attempt=1, saw_token=False, busy=True
    )


def test_bad_retry_policies_are_refused():
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="initial_backoff_s <= max_backoff_s"):
        RetryPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


class OneShot(io.RawIOBase):
    """A pipe-like file: readable once, not seekable."""

    def __init__(self, data: bytes) -> None:
        self.buf = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.buf.readinto(b)


@pytest.mark.parametrize("kind", ["path", "str", "bytes", "file", "one_shot"])
def test_every_media_source_gives_the_same_chunks_twice(tmp_path, kind):
    data = bytes(range(256)) * 41  # 10,496 bytes -> 11 chunks of 1000
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    f = open(path, "rb")  # noqa: SIM115 - closed below
    f.read(10)  # a seekable file is uploaded from where it stands, like shutil.copyfileobj
    media = {
        "path": path,
        "str": str(path),
        "bytes": data,
        "file": f,
        "one_shot": io.BufferedReader(OneShot(data)),
    }
    expected = data[10:] if kind == "file" else data
    source = MediaSource(media[kind], chunk_bytes=1000)
    for _ in range(2):  # a retried call re-sends from the start
        chunks = list(source.chunks())
        assert b"".join(chunks) == expected and max(len(c) for c in chunks) == 1000
    assert source.num_bytes == len(expected)
    assert source.sha256 == hashlib.sha256(expected).hexdigest()
    f.close()


def test_media_source_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such video file"):
        MediaSource(tmp_path / "missing.mp4")
    with pytest.raises(IsADirectoryError, match="is a directory; pass a video or image file"):
        MediaSource(tmp_path)  # was "no such video file", of a directory that is there
    with pytest.raises(TypeError, match="must be a path, bytes or a binary file object, not int"):
        MediaSource(3)  # type: ignore[arg-type]


def test_header_carries_options_and_leaves_zeros_to_the_server():
    h = build_header(
        "q?",
        12,
        "ab" * 32,
        {
            "num_frames": 8,
            "max_new_tokens": 16,
            "temperature": 0.0,
            "stop": "END",
            "pruning": "light",
            "pruning_knobs": {"keep": 0.5},
        },
    )
    assert (h.question, h.media_num_bytes, h.media_sha256) == ("q?", 12, "ab" * 32)
    assert h.sampling.num_frames == 8 and h.sampling.fps == 0.0
    assert h.generation.max_new_tokens == 16 and list(h.generation.stop) == ["END"]
    assert h.pruning.preset == "light" and dict(h.pruning.knobs) == {"keep": "0.5"}
    with pytest.raises(TypeError, match=r"unknown options: \['frames'\]"):
        build_header("q?", 0, "", {"frames": 3})
    assert not h.generation.HasField("seed")  # unset: the gateway draws one for a sampled request


def test_a_zero_seed_is_sent_and_zeros_that_mean_something_else_are_refused():
    """seed=0 went out as unset; top_p=0 and max_new_tokens=0 silently became the server's
    defaults (all tokens; 32 tokens)."""
    h = build_header("q?", 0, "", {"seed": 0, "temperature": 1.0})
    assert h.generation.HasField("seed") and h.generation.seed == 0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        build_header("q?", 0, "", {"top_p": 0})
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        build_header("q?", 0, "", {"max_new_tokens": 0})
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0 \(None: 1, off\)"):
        build_header("q?", 0, "", {"repetition_penalty": 0})


@pytest.mark.parametrize(
    "options,match",
    [
        ({"temperature": -1.0}, r"temperature must be a finite number >= 0 \(0: greedy\), got -1.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"logprobs": -1}, "logprobs must be >= 0, the number of most likely tokens"),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be >= 0, the number of most likely tokens"),
    ],
)
def test_a_negative_temperature_or_logprobs_is_refused_before_any_call(options, match):
    """They went out, for the server to refuse (or, a NaN temperature, for the wire to carry):
    the SDK says what to change before any call, as for top_p. Zero and above are sent."""
    with pytest.raises(ValueError, match=match):
        build_header("q?", 0, "", options)
    h = build_header("q?", 0, "", {"temperature": 0.5, "logprobs": 0, "prompt_logprobs": 3})
    assert (h.generation.temperature, h.generation.logprobs, h.generation.prompt_logprobs) == (0.5, 0, 3)
    assert h.generation.HasField("logprobs")


def test_header_carries_vllm_sampling_options():
    h = build_header("q?", 0, "", {
        "repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 0.5, "min_p": 0.05,
        "min_tokens": 3, "logit_bias": {17: 100.0}, "stop_token_ids": [5, 9], "include_stop_str_in_output": True,
    })  # fmt: skip
    g = h.generation
    assert (g.repetition_penalty, g.presence_penalty, g.frequency_penalty, g.min_p, g.min_tokens) == (
        1.3,
        -0.5,
        0.5,
        0.05,
        3,
    )
    assert (
        dict(g.logit_bias) == {17: 100.0}
        and list(g.stop_token_ids) == [5, 9]
        and g.include_stop_str_in_output
    )
    h = build_header("q?", 0, "", {"allowed_token_ids": (4, 17), "bad_words": ["red", " big cat"]})
    assert list(h.generation.allowed_token_ids) == [4, 17] and list(h.generation.bad_words) == [
        "red",
        " big cat",
    ]


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"num_frames": 2.5}, TypeError, r"num_frames must be an integer, got 2.5"),
        ({"max_new_tokens": "4"}, TypeError, r"max_new_tokens must be an integer, got '4'"),
        ({"ignore_eos": "no"}, TypeError, r"ignore_eos must be True or False, got 'no'"),
        ({"stop": 5}, TypeError, r"stop must be a string or a list of strings, got 5"),
        ({"stop": ["a", 5]}, TypeError, r"stop must be a string or a list of strings"),
        ({"stop_token_ids": [1.5]}, TypeError, r"stop_token_ids must be a list of integers"),
        ({"logit_bias": {"x": 1}}, TypeError, r"logit_bias keys must be token ids"),
        ({"logit_bias": {5: "up"}}, TypeError, r"logit_bias must be a dict of integers to numbers"),
        ({"seed": 2**70}, ValueError, r"seed must be an integer of at most 64 bits"),
        ({"allowed_token_ids": [1.5]}, TypeError, r"allowed_token_ids must be a list of integers"),
        # the wire cannot tell an empty list from unset (every token): refused, as the HTTP API's 400
        ({"allowed_token_ids": []}, ValueError, r"allowed_token_ids is empty, which allows no token"),
        # protobuf would have sent each character as a word
        (
            {"bad_words": "red"},
            TypeError,
            r"bad_words must be a list of strings, such as \['red'\], got 'red'",
        ),
        ({"bad_words": ["red", 5]}, TypeError, r"bad_words must be a list of strings"),
        (
            {"stop": ["\ud800"]},
            ValueError,
            r"stop must be a list of strings of valid Unicode \(no lone surrogates\)",
        ),
        ({"pruning": {"preset": "light"}}, TypeError, r'pruning must be a preset name such as "balanced"'),
        ({"cache_salt": 7}, TypeError, r"cache_salt must be a string, got 7"),
    ],
)
def test_an_option_of_the_wrong_type_is_refused_by_its_name(options, error, match):
    """protobuf's own errors ("bad argument type for built-in operation", "'str' object cannot be
    interpreted as an integer") named neither the option nor what it takes."""
    with pytest.raises(error, match=match):
        build_header("q?", 0, "", options)


def test_logit_bias_takes_the_openai_bodys_string_ids_too():
    h = build_header("q?", 0, "", {"logit_bias": {"17": -100, 5: 2.5}})
    assert dict(h.generation.logit_bias) == {17: -100.0, 5: 2.5}


def test_an_empty_conversation_is_refused_before_any_call():
    """It reached the gateway as the 0.1 question form with no question: "the question is empty"."""
    with pytest.raises(ValueError, match="messages is empty"):
        build_header(None, 0, "", {}, messages=[])


def test_a_tokenize_request_carries_its_options_and_leaves_defaults_unset():
    """Unset add_special_tokens and template go as unset, for the server's vLLM defaults."""
    plain = tokenize_request("hi", None, None, None, None, False, "")
    assert (plain.prompt, plain.HasField("add_special_tokens"), plain.HasField("template")) == (
        "hi",
        False,
        False,
    )
    chat = tokenize_request(None, [{"role": "user", "content": "hi"}], True, False, True, True, "r1")
    assert not chat.HasField("prompt") and [m.role for m in chat.messages] == ["user"]
    assert (chat.add_special_tokens, chat.return_token_strs, chat.request_id) == (True, True, "r1")
    assert chat.template.HasField("add_generation_prompt") and not chat.template.add_generation_prompt
    assert chat.template.continue_final_message
    thinking = tokenize_request(
        None, [{"role": "user", "content": "hi"}], None, None, None, False, "", {"enable_thinking": False}
    )
    assert json.loads(thinking.template.chat_template_kwargs_json) == {"enable_thinking": False}
    assert not thinking.template.HasField("chat_template")


def test_the_sdk_sends_a_request_template_as_it_is():
    """vLLM's request `chat_template` (the server decides whether it trusts it); not a str: TypeError."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    header = build_header("what moves?", 0, "", {"chat_template": template})
    assert header.template.chat_template == template and not header.template.HasField("add_generation_prompt")
    counted = tokenize_request(
        None, [{"role": "user", "content": "hi"}], None, None, None, False, "", None, template
    )
    assert counted.template.chat_template == template
    with pytest.raises(TypeError, match="chat_template must be a Jinja template's text"):
        build_header("what moves?", 0, "", {"chat_template": {"default": template}})


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            ("hi", [{"role": "user", "content": "hi"}]),
            TypeError,
            "pass a prompt .* or messages=.*one of them",
        ),
        ((None, None), TypeError, "one of them"),
        ((["hi"], None), TypeError, "prompt must be a string"),
        ((None, []), ValueError, "messages is empty"),
    ],
)
def test_a_bad_tokenize_request_is_refused_before_any_call(args, error, match):
    with pytest.raises(error, match=match):
        tokenize_request(*args, None, None, None, False, "")
    with pytest.raises(TypeError, match="return_token_strs must be True or False"):
        tokenize_request("hi", None, None, None, None, 1, "")


def test_a_header_over_the_message_limit_is_refused_before_any_call():
    """gRPC refused to send it with "Sent message larger than max (5000022 vs. 4194304)"; the
    endpoint here answers nothing, so any call made would be UNAVAILABLE instead."""
    with EpdClient("127.0.0.1:1", retry=NO_RETRY) as client:
        with pytest.raises(EpdError, match="send a shorter conversation") as info:
            client.ask(b"video bytes", "x" * (5 << 20))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"timeout_s": None}, "timeout_s must be a positive number of seconds"),
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds"),
        ({"chunk_bytes": 8 << 20}, "chunk_bytes must be from 1 to"),
        ({"chunk_bytes": 0}, "chunk_bytes must be from 1 to"),
    ],
)
def test_a_client_setting_out_of_range_is_refused_when_the_client_is_made(settings, match):
    """timeout_s=None failed each call with "unsupported operand type(s) for +"; a chunk over the
    message limit failed each upload with gRPC's "Sent message larger than max"."""
    with pytest.raises(ValueError, match=match):
        AsyncEpdClient("127.0.0.1:1", **settings)


def test_api_key_goes_out_as_bearer_metadata_and_is_checked_exactly():
    metadata = ChannelSettings(api_key="s3cret", metadata=(("x-team", "vision"),)).call_metadata()
    assert metadata == (("authorization", "Bearer s3cret"), ("x-team", "vision"))
    assert bearer_token(metadata) == "s3cret" and key_matches("s3cret", "s3cret")
    assert bearer_token([("authorization", "Basic s3cret")]) == ""
    assert not key_matches("s3cre", "s3cret") and not key_matches("", "s3cret")


def test_tls_needs_an_existing_root_certificate_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="root certificates file not found"):
        channel_credentials(ChannelSettings(root_certificates_path=str(tmp_path / "ca.pem")))
    with pytest.raises(FileNotFoundError, match="root certificates file not found"):
        # made, not first called
        AsyncEpdClient("127.0.0.1:1", root_certificates_path=str(tmp_path / "ca.pem"))


def test_a_client_certificate_needs_its_key_and_existing_files(tmp_path):
    with pytest.raises(ValueError, match="client_certificate_path and client_key_path go together"):
        ChannelSettings(client_certificate_path=str(tmp_path / "client.pem"))
    settings = ChannelSettings(
        client_certificate_path=str(tmp_path / "client.pem"), client_key_path=str(tmp_path / "client.key")
    )
    assert settings.uses_tls  # a client certificate is TLS even without a CA given
    with pytest.raises(FileNotFoundError, match="client certificate file not found"):
        channel_credentials(settings)


def _client_threads() -> int:
    return sum(t.name == "epd-client" for t in threading.enumerate())


def test_a_client_that_fails_to_start_leaves_no_thread_running(tmp_path):
    before = _client_threads()
    for _ in range(3):
        with pytest.raises(FileNotFoundError, match="root certificates file not found"):
            EpdClient("127.0.0.1:1", root_certificates_path=str(tmp_path / "ca.pem"))
        with pytest.raises(ValueError, match="client_certificate_path and client_key_path go together"):
            EpdClient("127.0.0.1:1", client_certificate_path=str(tmp_path / "client.pem"))
    assert _client_threads() == before  # each failure left an event loop running in its thread


def test_a_closed_client_says_so_without_a_warning(tmp_path):
    client = EpdClient("127.0.0.1:1")
    chat = client.conversation(b"some video bytes")
    client.close()
    client.close()  # again: nothing to do
    gc.collect()  # earlier tests' garbage (an event loop they left) warns now, not in the record below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (lambda: client.ask(b"some video bytes", "q?"), lambda: list(client.stream(b"v", "q?")),
                     lambda: client.upload_or_reuse(b"v", "q?"), lambda: chat.ask("q?")):  # fmt: skip
            with pytest.raises(RuntimeError, match="the client is closed"):
                call()
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert [str(w.message) for w in caught] == []


GONE_WITHIN_S = 30.0
"""How long a dropped client's thread and socket may take to go: a bound for a hang, not a timing check."""


@pytest.fixture
def health_server():
    """A gRPC server with only the health service (a client's call to it connects and is
    answered UNIMPLEMENTED): (its port, a count of the client sockets connected to it)."""
    import psutil
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    def client_sockets() -> int:
        return sum(
            bool(c.raddr) and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            for c in psutil.Process().net_connections(kind="tcp")
        )

    try:
        yield port, client_sockets
    finally:
        server.stop(None)


def connected_client(port: int) -> EpdClient:
    client = EpdClient(f"127.0.0.1:{port}", retry=NO_RETRY)
    with pytest.raises(EpdError) as raised:  # a call, so that the channel connects
        client.detokenize([1])
    assert raised.value.code == grpc.StatusCode.UNIMPLEMENTED  # no gateway service there: connected
    return client


def wait_until_gone(expected: tuple[int, int], client_sockets) -> None:
    """Until the client threads and sockets are back to `expected` (a bound for a hang)."""
    end_at = time.monotonic() + GONE_WITHIN_S
    while (_client_threads(), client_sockets()) != expected:
        assert time.monotonic() < end_at, (
            f"{_client_threads()} client threads and {client_sockets()} sockets still open"
        )
        time.sleep(0.05)


def unclosed_warning(port: int) -> str:
    return f"unclosed EpdClient for 127.0.0.1:{port}: close() it, or use `with EpdClient(...) as client:`"


def test_a_client_dropped_without_close_is_closed_by_the_garbage_collector_with_a_warning(health_server):
    """It lived until the interpreter exited (a module-level set held it for the exit's close), its
    thread, event loop, channel and connection with it. Now `del` and a collection close it, with
    a ResourceWarning, as Python's unclosed files and grpc's channels are handled."""
    port, client_sockets = health_server
    threads_before, sockets_before = _client_threads(), client_sockets()
    client = connected_client(port)
    assert _client_threads() == threads_before + 1 and client_sockets() == sockets_before + 1
    gc.collect()  # earlier tests' garbage warns now, not in the record below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del client
        gc.collect()
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == [unclosed_warning(port)]
    wait_until_gone((threads_before, sockets_before), client_sockets)


def test_a_client_collected_on_its_own_loops_thread_still_closes(health_server, monkeypatch):
    """The collector may run on any thread, the client's own among them (a cycle that holds the
    client, found by a collection its loop's work set off): there the finalizer cannot wait for
    the loop to close the client, as it does from any other thread (it would wait for itself, and
    the thread, channel and connection would stay); it leaves the loop to close it and stop."""
    from epd.client import client as client_module

    port, client_sockets = health_server
    threads_before, sockets_before = _client_threads(), client_sockets()
    client = connected_client(port)
    loop, client_thread = client._parts.loop, client._parts.thread
    closed_on: list[threading.Thread] = []
    real_close = client_module._close
    monkeypatch.setattr(
        client_module,
        "_close",
        lambda parts: (closed_on.append(threading.current_thread()), real_close(parts)),
    )
    gc.collect()  # earlier tests' garbage warns now, not in the record below
    gc.disable()  # only the collection on the client's thread below may find the cycle
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cycle: list = [client]
            cycle.append(cycle)
            del client, cycle  # only the cycle holds the client now
            loop.call_soon_threadsafe(gc.collect)
            client_thread.join(GONE_WITHIN_S)  # a bound for a hang: the thread stops once the client closed
        assert closed_on == [client_thread]
        assert [str(w.message) for w in caught if w.category is ResourceWarning] == [unclosed_warning(port)]
    finally:
        gc.enable()
    assert not client_thread.is_alive() and loop.is_closed()
    wait_until_gone((threads_before, sockets_before), client_sockets)


def test_asking_about_a_directory_says_it_is_one(tmp_path):
    with EpdClient("127.0.0.1:1") as client, pytest.raises(IsADirectoryError, match="is a directory"):
        client.ask(tmp_path, "q?")


def test_a_server_name_alone_makes_the_channel_tls_not_plaintext():
    """`server_name_override` (epd ask --tls-server-name) means TLS: alone, the channel stayed
    plaintext and sent the API key in clear, so a call to a plaintext server succeeded."""
    import asyncio

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def run() -> str:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        settings = ChannelSettings(server_name_override="gateway.example", api_key="secret-key")
        channel = open_channel(f"127.0.0.1:{port}", settings, RetryPolicy(), channel_credentials(settings))
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            return f"plaintext call answered {reply.status}"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        finally:
            await channel.close()
            await server.stop(0)

    assert ChannelSettings(server_name_override="gateway.example").uses_tls
    assert asyncio.run(run()) == "UNAVAILABLE"  # a TLS handshake a plaintext server cannot answer


def test_a_passed_deadline_says_what_helps_for_the_call_it_cut():
    # An ask's answer is shortened by fewer tokens or frames; a tokenize call's is not: its
    # message names only the deadline.
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Deadline Exceeded"
    )
    asked = _call_error(exc, time.monotonic() - 1, 2.0, "or ask for fewer tokens or frames")
    tokenized = _call_error(exc, time.monotonic() - 1, 2.0)
    assert asked.message.endswith("raise timeout_s, or ask for fewer tokens or frames"), asked.message
    assert tokenized.message == "no answer within the call's deadline (2 s, timeout_s); raise timeout_s"
