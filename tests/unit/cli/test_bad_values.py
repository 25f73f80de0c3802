"""Bad input to `epd` is one line saying what to change and the right exit code (2 for a flag
value), never a traceback nor a server's INTERNAL error; and `epd health` tells an answer of
NOT_SERVING from no answer at all."""

from __future__ import annotations

import signal
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epd.cli import configs
from epd.cli.ask import run_ask
from epd.cli.health import check_health
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_USAGE
from epd.cli.serve import serve_role
from epd.stages.server_config import TransportSecurity
from epd.transport import security
from epd.transport.ports_file import free_port
from epd.video.types import SamplingOptions
from tests.pki import make_pki
from tests.stack import ROOT

VIDEO = str(ROOT / "samples" / "sample.mp4")


def _usage_error(capsys, argv: list[str]) -> str:
    """argparse's exit 2 for `argv`, and its message."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "encoder", "--port", "70001"],
        ["serve", "gateway", "--port", "65536"],
        ["serve", "gateway", "--http-port", "-5"],
        ["serve", "--gateway-port", "70001"],
        ["serve", "--encoder-port", "-1"],
        ["serve", "--prefill-port", "65536"],
        ["serve", "--decode-port", "100000"],
        ["serve", "--http-port", "70001"],
    ],
)
def test_a_port_beyond_65535_or_below_0_is_refused(capsys, argv):
    err = _usage_error(capsys, argv)
    assert f"argument {argv[-2]}: must be 0 to 65535 (a TCP port), got '{argv[-1]}'" in err


def test_ports_at_the_ends_of_the_range_are_taken(capsys):
    args = build_parser().parse_args(["serve", "gateway", "--port", "65535", "--http-port", "0"])
    assert (args.port, args.http_port) == (65535, 0)
    assert "expected a port number, got 'http'" in _usage_error(
        capsys, ["serve", "encoder", "--port", "http"]
    )


@pytest.fixture
def restored_process():
    """serve_role sets SIGTERM's handler and this process's transport security: put them back."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
    security.configure(TransportSecurity())


@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--max-requests-per-client", "-1"],
            "epd serve gateway: --max-requests-per-client must be >= 1, got -1",
        ),
        (["--max-requests-per-api-key", "-2"], "--max-requests-per-api-key must be >= 0"),
        (["--max-inflight-body-bytes", "5"], "--max-inflight-body-bytes 5 is below the largest request body"),
        (["--api-key", ""], "epd serve gateway: --api-key is empty"),  # was a traceback, exit 1
        (
            ["--override-generation-config", "{"],
            "epd serve gateway: --override-generation-config is not JSON",
        ),
        (["--generation-config", "/no/such/folder"], "no generation_config.json in that folder"),
    ],
)
def test_a_gateway_limit_it_refuses_is_one_line_and_exit_2(capsys, restored_process, flags, expected):
    """Checked before the event loop starts: there it was a traceback and exit 1."""
    args = build_parser().parse_args(["serve", "gateway", "--port", "0", *flags])
    assert serve_role(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_api_keys_lose_the_whitespace_no_bearer_header_carries(monkeypatch):
    """A key pasted with a trailing space (or newline) could never match: the header's token is
    stripped. Kept as given, every request was refused."""
    monkeypatch.setenv("EPD_API_KEY", " from-env\n")
    assert configs.api_keys(build_parser().parse_args(["serve", "gateway"])) == ("from-env",)
    args = build_parser().parse_args(["serve", "gateway", "--api-key", "k1 ", "--api-key", " k2"])
    assert configs.api_keys(args) == ("k1", "k2")


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_prefill_on_every_interface_needs_an_address_to_advertise(capsys, restored_process, host):
    """It advertised HOST:PORT, here 0.0.0.0:50052, to the decoders, which cannot dial it: every
    request failed at the KV pull, with an error about --allow-kv-from."""
    args = build_parser().parse_args(["serve", "prefill", "--host", host, "--insecure-no-internal-auth"])
    with pytest.raises(ValueError, match="not an address decoders can dial"):
        configs.prefill_config(args)
    assert serve_role(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        "pass --advertise-address HOST:PORT" in err
        and "Traceback" not in err
        and len(err.strip().splitlines()) == 1
    )
    advertised = build_parser().parse_args(
        ["serve", "prefill", "--host", host, "--advertise-address", "p:50052"]
    )
    assert configs.prefill_config(advertised).advertise_address == "p:50052"


def test_a_gateway_upload_limit_below_1_is_refused():
    """(Not through serve_role: unchecked, the gateway would start and serve, refusing every upload.)"""
    args = build_parser().parse_args(["serve", "gateway", "--max-upload-bytes", "-1"])
    with pytest.raises(ValueError, match="--max-upload-bytes must be >= 1, got -1"):
        configs.gateway_config(args)


def test_the_colocated_front_door_checks_its_limits_too():
    args = build_parser().parse_args(["serve", "--colocate", "--max-requests-per-client", "0"])
    with pytest.raises(ValueError, match="--max-requests-per-client must be >= 1, got 0"):
        configs.colocated_gateway_config(args)


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--stage-check-interval", "-1", "must be >= 0 seconds"),
        ("--stage-attempt-timeout", "-1", "must be >= 0 seconds"),
        ("--load-refresh-interval", "-0.5", "must be >= 0 seconds"),
        ("--media-fetch-timeout", "0", "must be > 0 seconds"),
        ("--body-timeout", "0", "must be > 0 seconds"),
    ],
)
def test_a_gateway_interval_below_0_is_refused(capsys, flag, value, expected):
    assert f"argument {flag}: {expected}" in _usage_error(capsys, ["serve", "gateway", flag, value])


def test_the_gateway_intervals_0_still_mean_off():
    args = build_parser().parse_args(
        [
            "serve",
            "gateway",
            "--stage-check-interval",
            "0",
            "--stage-attempt-timeout",
            "0",
            "--load-refresh-interval",
            "0",
        ]
    )
    config = configs.gateway_config(args)
    assert (
        config.stage_check_interval_s,
        config.stage_attempt_timeout_s,
        config.load_refresh_interval_s,
    ) == (0, 0, 0)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _ask(*argv: str) -> int:
    return run_ask(build_parser().parse_args(["ask", *argv]))


@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--tls-ca", "/missing.pem"],
            "epd: --tls-ca /missing.pem: cannot read it (No such file or directory)",
        ),
        (["--tls-ca", VIDEO], f"epd: --tls-ca {VIDEO}: not a PEM file"),
        (
            ["--tls-ca", "CA", "--tls-cert", "/missing.pem", "--tls-key", "KEY"],
            "epd: --tls-cert /missing.pem: cannot read it",
        ),
        (
            ["--tls-ca", "CA", "--tls-cert", "CERT", "--tls-key", "/missing.key"],
            "epd: --tls-key /missing.key: cannot read it",
        ),
        (
            ["--tls-ca", "CA", "--tls-cert", "CERT", "--tls-key", "STRANGER_KEY"],
            "epd: --tls-cert/--tls-key: not a certificate and its matching key",
        ),
    ],
)
def test_epd_ask_names_a_tls_file_it_cannot_use(capsys, pki, flags, expected):
    """The client's own files: exit 2 naming the flag, not the server's "INTERNAL" (exit 1)."""
    paths = {
        "CA": pki["ca"],
        "CERT": pki["client"][0],
        "KEY": pki["client"][1],
        "STRANGER_KEY": pki["stranger"][1],
    }
    assert _ask(VIDEO, "q?", "--endpoint", "127.0.0.1:1", *(paths.get(f, f) for f in flags)) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.strip().splitlines()) == 1


def test_epd_ask_with_a_bad_device_is_a_usage_error(capsys):
    """Embedded mode's model config is built before the event loop: its ValueError is exit 2."""
    assert _ask(VIDEO, "q?", "--device", "bogus") == 2
    assert capsys.readouterr().err.strip() == "epd: device must be 'cpu' or 'cuda[:N]', got 'bogus'"


@pytest.mark.parametrize(
    "where,expected",
    [
        ("directory", "is a directory; give the path of a video or image file"),
        ("missing", "no such file: "),
        ("/dev/null", "/dev/null is not a regular file"),
    ],
)
def test_epd_ask_says_what_its_video_path_is(capsys, tmp_path, where, expected):
    path = {"directory": str(tmp_path), "missing": str(tmp_path / "nope.mp4")}.get(where, where)
    assert _ask(path, "q?") == 2
    err = capsys.readouterr().err
    assert expected in err and path in err


def _health_server(credentials: grpc.ServerCredentials | None = None):
    """A gRPC server on loopback whose health answers NOT_SERVING (plaintext, or `credentials`),
    its address and its health servicer."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = (
        server.add_insecure_port("127.0.0.1:0")
        if credentials is None
        else server.add_secure_port("127.0.0.1:0", credentials)
    )
    server.start()
    return server, f"127.0.0.1:{port}", servicer


def _health(*argv: str) -> int:
    """`epd health ARGV` as main runs it (its TLS flags, then the check), without main's logging set-up."""
    args = build_parser().parse_args(["health", *argv])
    security.configure(configs.health_security(args))
    return check_health(args.address, args.service, args.timeout)


@pytest.fixture
def plain_security():
    yield
    security.configure(TransportSecurity())


def test_epd_health_tells_not_serving_from_no_answer(capsys, plain_security):
    server, address, servicer = _health_server()
    try:
        assert _health(address) == 1
        assert capsys.readouterr().err.strip() == "NOT_SERVING"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _health(address) == 0
        assert capsys.readouterr().err.strip() == "SERVING"
        assert _health(address, "--service", "no.such.Service") == 1
        assert capsys.readouterr().err.startswith("NOT_SERVING (NOT_FOUND")
    finally:
        server.stop(None)
    nobody = f"127.0.0.1:{free_port()}"
    assert _health(nobody, "--timeout", "5") == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"no answer from {nobody} within 5 s (UNAVAILABLE")
        and len(err.strip().splitlines()) == 1
    )


@pytest.mark.parametrize("timeout", ["0", "-1", "soon"])
def test_epd_health_timeout_must_be_positive(capsys, timeout):
    assert "argument --timeout:" in _usage_error(capsys, ["health", "127.0.0.1:1", "--timeout", timeout])


def test_epd_health_refuses_tls_flags_that_do_not_go_together(pki):
    cert, key = pki["client"]
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        configs.health_security(parse(["health", "127.0.0.1:1", "--tls-ca", pki["ca"], "--tls-cert", cert]))
    # else plaintext, the certificate unsent
    with pytest.raises(ValueError, match="--tls-cert needs --tls-ca"):
        configs.health_security(parse(["health", "127.0.0.1:1", "--tls-cert", cert, "--tls-key", key]))


def test_epd_health_presents_a_client_certificate_to_an_mtls_port(capsys, pki, plain_security):
    """What the gateway's probes run once --tls-client-ca is added (deploy/k8s-tls, compose): with
    the pod's own certificate the handshake passes; without one there is no answer, said so."""
    cert, key = pki["service"]
    with open(cert, "rb") as c, open(key, "rb") as k, open(pki["ca"], "rb") as ca:
        mtls = grpc.ssl_server_credentials(
            [(k.read(), c.read())], root_certificates=ca.read(), require_client_auth=True
        )
    server, address, servicer = _health_server(mtls)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        assert _health(address, "--tls-ca", pki["ca"], "--tls-cert", cert, "--tls-key", key) == 0
        assert capsys.readouterr().err.strip() == "SERVING"
        assert _health(address, "--tls-ca", pki["ca"]) == 1
        assert capsys.readouterr().err.startswith(f"no answer from {address}")
    finally:
        server.stop(None)


def test_epd_ask_embedded_says_a_model_it_cannot_load_with_exit_3(capsys, tmp_path):
    """As `epd serve` does: exit 3 and the loader's line, not the server's FAILED_PRECONDITION (exit 1)."""
    missing = tmp_path / "no-model"
    assert _ask(VIDEO, "q?", "--model", str(missing)) == 3
    assert capsys.readouterr().err.strip().endswith(f"epd: cannot load {missing}: no such directory")


def test_epd_ask_reads_vllm_sampling_flags_for_both_modes(capsys):
    """The embedded pipeline gets them as a GenerationConfig, a remote gateway as the SDK's options."""
    args = build_parser().parse_args([
        "ask", VIDEO, "q?", "--repetition-penalty", "1.3", "--presence-penalty", "-0.5", "--frequency-penalty",
        "0.5", "--min-p", "0.1", "--min-tokens", "2", "--logit-bias", "17=100", "--logit-bias", "5=-2.5",
        "--stop-token-id", "7", "--include-stop-str-in-output", "--allowed-token-id", "9", "--allowed-token-id",
        "4", "--bad-word", "red", "--bad-word", "big cat",
    ])  # fmt: skip
    generation = configs.generation_config(args)
    assert (generation.repetition_penalty, generation.presence_penalty, generation.frequency_penalty) == (
        1.3,
        -0.5,
        0.5,
    )
    assert (generation.min_p, generation.min_tokens, generation.stop_token_ids) == (0.1, 2, (7,))
    assert generation.logit_bias == ((5, -2.5), (17, 100.0)) and generation.include_stop_str_in_output
    assert generation.allowed_token_ids == (9, 4) and generation.bad_words == ("red", "big cat")
    options = configs.generation_options(args)
    assert options["logit_bias"] == {5: -2.5, 17: 100.0} and options["min_tokens"] == 2
    assert options["allowed_token_ids"] == [9, 4] and options["bad_words"] == ("red", "big cat")
    # without the flag: every token (None), which the SDK sends as unset; an empty list it refuses
    assert (
        configs.generation_options(build_parser().parse_args(["ask", VIDEO, "q?"]))["allowed_token_ids"]
        is None
    )
    assert "expected TOKEN_ID=BIAS (e.g. 1734=-100), got 'x'" in _usage_error(
        capsys, ["ask", VIDEO, "q?", "--logit-bias", "x"]
    )


def test_epd_ask_reads_structured_output_flags_for_both_modes(capsys, tmp_path):
    """--json-schema FILE, --json-object, --regex, --choice, --grammar FILE: one StructuredOutputs,
    the same on the SDK's wire; two at once, or a file that is not a schema, is a usage error."""
    from epd.client.request import build_header
    from epd.model_runtime.sampling import StructuredOutputs

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}}')
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "yes" | "no"')
    for flags, want in [
        (["--json-schema", str(schema)], StructuredOutputs(json_schema='{"type":"object","properties":{"n":{"type":"integer"}}}')),
        (["--json-object"], StructuredOutputs(json_object=True)),
        (["--regex", "[0-9]+"], StructuredOutputs(regex="[0-9]+")),
        (["--choice", "red", "--choice", "blue"], StructuredOutputs(choice=("red", "blue"))),
        (["--grammar", str(grammar)], StructuredOutputs(grammar='root ::= "yes" | "no"')),
        ([], None),
    ]:  # fmt: skip
        args = build_parser().parse_args(["ask", VIDEO, "q?", *flags])
        assert configs.generation_config(args).structured_outputs == want
        header = build_header("q?", 1, "0" * 64, configs.generation_options(args))
        assert header.generation.HasField("structured_outputs") == (want is not None)
        if want is not None:
            assert tuple(header.generation.structured_outputs.choice) == want.choice
            assert header.generation.structured_outputs.json_schema == want.json_schema
    assert "not allowed with argument" in _usage_error(
        capsys, ["ask", VIDEO, "q?", "--regex", "a", "--json-object"]
    )
    (tmp_path / "list.json").write_text("[1]")
    assert "must hold a JSON Schema object" in _usage_error(
        capsys, ["ask", VIDEO, "q?", "--json-schema", str(tmp_path / "list.json")]
    )
    assert "cannot read" in _usage_error(capsys, ["ask", VIDEO, "q?", "--grammar", str(tmp_path / "none")])


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--temperature", "-1"], "epd: temperature must be a finite number >= 0 (0: greedy), got -1.0"),
        (["--logprobs", "-1"], "epd: logprobs must be >= 0, the number of most likely tokens shown"),
        (["--prompt-logprobs", "-3"], "epd: prompt_logprobs must be >= 0, the number of most likely tokens"),
    ],
)
@pytest.mark.parametrize("mode", ["embedded", "endpoint"])
def test_epd_ask_refuses_a_negative_temperature_or_logprobs_before_any_call(
    capsys, tmp_path, flags, expected, mode
):
    """The SDK's message, exit 2, in both modes: against --endpoint (nothing listens on port 1) it
    went to the server (here: UNAVAILABLE, exit 1); embedded, the model would load first (here: a
    model that does not exist, exit 3)."""
    where = ["--endpoint", "127.0.0.1:1"] if mode == "endpoint" else ["--model", str(tmp_path / "no-model")]
    assert _ask("--no-video", "q?", *where, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and len(err.strip().splitlines()) == 1, err


def test_epd_ask_embedded_holds_logprobs_to_its_servers_bound(capsys, tmp_path):
    """Embedded mode runs its servers with vLLM's default --max-logprobs (20): more is refused
    before the model loads, saying where the bound comes from; 20 passes (to the model's load)."""
    from epd.prefill_svc.config import PrefillConfig

    limit = PrefillConfig.max_logprobs
    for flag in ("--logprobs", "--prompt-logprobs"):
        assert _ask("--no-video", "q?", "--model", str(tmp_path / "no-model"), flag, str(limit + 1)) == 2
        assert capsys.readouterr().err.startswith(
            f"epd: {flag} must be between 0 and {limit} (embedded mode's bound, vLLM's default --max-logprobs"
        )
        assert _ask("--no-video", "q?", "--model", str(tmp_path / "no-model"), flag, str(limit)) == 3
        capsys.readouterr()


def test_epd_ask_refuses_a_chat_template_with_a_raw_prompt(capsys, tmp_path):
    """--prompt runs its text without a template, so --chat-template would be ignored silently
    (embedded): refused before the model loads, as --chat-template-kwargs is."""
    where = ["--model", str(tmp_path / "no-model")]
    assert _ask("--prompt", "the sky is", *where, "--chat-template", "{{ messages }}") == 2
    assert capsys.readouterr().err.strip() == (
        "epd: --chat-template renders a chat's prompt; --prompt has no template: drop one"
    )


def test_epd_ask_reads_logprobs_flags_for_both_modes():
    args = build_parser().parse_args(["ask", VIDEO, "q?", "--logprobs", "3", "--prompt-logprobs", "0"])
    generation = configs.generation_config(args)
    assert (generation.logprobs, generation.prompt_logprobs) == (3, 0)
    options = configs.generation_options(args)
    assert (options["logprobs"], options["prompt_logprobs"]) == (3, 0)
    unset = configs.generation_config(build_parser().parse_args(["ask", VIDEO, "q?"]))
    assert (unset.logprobs, unset.prompt_logprobs) == (None, None)


def test_epd_ask_takes_fps_or_num_frames_not_both(capsys):
    """As every door refuses the pair (a request's frame count or its rate); --fps is unset unless
    given, so `--num-frames N` alone sends no rate beside it (it sent the default 2)."""
    assert _ask(VIDEO, "q?", "--endpoint", "127.0.0.1:1", "--fps", "1", "--num-frames", "4") == 2
    assert capsys.readouterr().err.strip() == (
        "epd: --fps and --num-frames: give one (--num-frames N: exactly N frames; --fps F: F frames per "
        "second, at most --max-frames)"
    )
    assert build_parser().parse_args(["ask", VIDEO, "q?", "--num-frames", "4"]).fps is None
    assert (
        configs.sampling_options(build_parser().parse_args(["ask", VIDEO, "q?"])).fps == SamplingOptions.fps
    )
