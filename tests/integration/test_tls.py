"""A stack with mTLS between every service (certificates made here by `trustme`): it answers as
the plain stack does, and a client without a valid certificate cannot even connect to a stage."""

from __future__ import annotations

import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.client import EpdClient
from epd.stages.server_config import TransportSecurity
from epd.transport import security
from tests.pki import make_pki
from tests.stack import ROOT, Stack, child_env, epd_command

QUESTION = "what colour is the moving square?"
OPTIONS = {"num_frames": 4, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """One CA the stack trusts; a certificate for the services; one for a client; and a
    certificate of another CA, which the stack must not accept (tests/pki.py)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_stack(tiny_models, tmp_path_factory, pki):
    cert, key = pki["service"]
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"]]
    # Every stage requires client certificates of the CA; the gateway's public port is TLS only
    # (SDK clients present no certificate), and presents its own to the stages.
    extra = {name: [*tls, "--tls-client-ca", pki["ca"]] for name in ("encoder", "prefill", "decode")}
    extra["gateway"] = tls
    # The test's own health checks (Stack waits for SERVING) go over mTLS too.
    client_cert, client_key = pki["client"]
    security.configure(TransportSecurity(tls_cert=client_cert, tls_key=client_key, tls_ca=pki["ca"]))
    try:
        with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_tls"), extra=extra, http=True) as s:
            yield s
    finally:
        security.configure(TransportSecurity())


def test_the_mtls_stack_answers_like_the_plain_stack(tls_stack, shared_stack, media_files, pki):
    with EpdClient(tls_stack.gateway, timeout_s=120, root_certificates_path=pki["ca"]) as client:
        secured = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        plain = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
    assert secured.token_ids == plain.token_ids and secured.answer == plain.answer
    assert secured.kv_num_bytes > 0  # decode pulled the KV cache from prefill, over mTLS


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    )
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("stage", ["encoder", "prefill", "decode"])
def test_a_stage_refuses_a_client_without_a_valid_certificate(tls_stack, pki, stage):
    address = tls_stack.address(stage)
    ca = _read(pki["ca"])
    stranger_cert, stranger_key = pki["stranger"]
    client_cert, client_key = pki["client"]
    assert _health(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
    assert _health(address, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE  # no certificate
    # A certificate of another CA: refused as well.
    stranger = grpc.ssl_channel_credentials(ca, _read(stranger_key), _read(stranger_cert))
    assert _health(address, stranger) == grpc.StatusCode.UNAVAILABLE
    # The control: the CA's client certificate connects.
    ok = grpc.ssl_channel_credentials(ca, _read(client_key), _read(client_cert))
    assert _health(address, ok) == grpc.StatusCode.OK


def test_the_gateway_port_is_tls(tls_stack, pki):
    assert _health(tls_stack.gateway, None) == grpc.StatusCode.UNAVAILABLE
    assert _health(tls_stack.gateway, grpc.ssl_channel_credentials(_read(pki["ca"]))) == grpc.StatusCode.OK


def test_epd_health_probes_a_mtls_stage(tls_stack, pki):
    """The probe compose and Kubernetes run, with the flags of deploy/ and compose/."""
    client_cert, client_key = pki["client"]
    address = tls_stack.address("prefill")
    probe = ["health", address, "--tls-ca", pki["ca"]]
    ok = subprocess.run(
        epd_command(*probe, "--tls-cert", client_cert, "--tls-key", client_key),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(
        epd_command(*probe), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60
    )
    # The handshake is refused: no answer, said as such (not NOT_SERVING, the answer of a server that is up).
    assert refused.returncode == 1 and refused.stderr.startswith(f"no answer from {address}"), refused.stderr


def test_a_key_that_is_not_the_certificates_stops_the_service_at_start(pki):
    cert, _ = pki["service"]
    _, other_key = pki["client"]
    proc = subprocess.run(
        epd_command(
            "serve",
            "encoder",
            "--port",
            "0",
            "--tls-cert",
            cert,
            "--tls-key",
            other_key,
            "--insecure-no-internal-auth",
        ),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("epd serve encoder: --tls-cert/--tls-key: not a certificate and its matching key")


def test_a_missing_certificate_file_is_named(pki, tmp_path):
    _, key = pki["service"]
    missing = str(tmp_path / "nope.pem")
    proc = subprocess.run(
        epd_command("serve", "gateway", "--port", "0", "--tls-cert", missing, "--tls-key", key),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"epd serve gateway: --tls-cert {missing}: cannot read it (No such file or directory)"
    )


def test_the_http_api_serves_https_only(tls_stack, pki):
    """The gateway's HTTP port takes its --tls-cert too: HTTPS with the CA answers, plain HTTP and
    a client that does not trust the CA get no answer."""
    import ssl
    import urllib.error
    import urllib.request

    trusted = ssl.create_default_context(cafile=pki["ca"])
    with urllib.request.urlopen(
        f"https://127.0.0.1:{tls_stack.http_port}/health", context=trusted, timeout=30
    ) as reply:
        assert reply.status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_stack.http_port}/health", timeout=30)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(
            f"https://127.0.0.1:{tls_stack.http_port}/health",
            context=ssl.create_default_context(),
            timeout=30,
        )
