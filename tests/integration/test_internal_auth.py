"""The internal secret: stages started with one refuse every call without it (UNAUTHENTICATED,
saying what to configure) while their health still answers; the gateway presents it to the
stages and decode to prefill (its KV pulls), so the stack answers; `epd serve` makes its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.client import EpdClient, EpdError
from epd.transport.auth import MISSING_SECRET_MESSAGE
from epd.v1 import load_pb2, load_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.pki import make_pki
from tests.stack import INTERNAL_AUTH_METADATA, ROOT, Stack, bound_ports, child_env, epd_command

QUESTION = "what colour is the moving square?"
OPTIONS = {"num_frames": 4, "max_new_tokens": 6}
API_KEY = "key-of-the-tls-stack"


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_auth"), internal_secret=True) as s:
        yield s


def _channel(address: str, credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)


def _get_load(address: str, metadata=(), credentials=None) -> grpc.StatusCode | str:
    with _channel(address, credentials) as channel:
        try:
            load_pb2_grpc.LoadServiceStub(channel).GetLoad(
                load_pb2.GetLoadRequest(), timeout=10, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc.details() if exc.code() == grpc.StatusCode.UNAUTHENTICATED else exc.code()
    return grpc.StatusCode.OK


def _serving(address: str, credentials=None) -> bool:
    with _channel(address, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _credentials(pki: dict, pair: str | None) -> grpc.ChannelCredentials:
    key = chain = None
    if pair:
        chain, key = (Path(p).read_bytes() for p in pki[pair])
    return grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes(), key, chain)


def test_the_stack_answers_with_the_secret_presented_inside(stack, media_files):
    with EpdClient(stack.gateway, timeout_s=120) as client:
        result = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
    assert result.token_ids and result.kv_num_bytes > 0  # decode pulled the KV from prefill


@pytest.mark.parametrize("stage", ["encoder", "prefill", "decode"])
def test_a_stage_refuses_a_call_without_the_secret_but_answers_health(stack, stage):
    address = stack.address(stage)
    assert MISSING_SECRET_MESSAGE in _get_load(address)
    assert MISSING_SECRET_MESSAGE in _get_load(address, (("x-epd-internal-auth", "not-the-secret-at-all"),))
    assert _serving(address)  # probes need no secret
    assert _get_load(address, INTERNAL_AUTH_METADATA) == grpc.StatusCode.OK


def test_prefill_refuses_kv_pulls_and_releases_without_the_secret(stack):
    """What a decoder calls: without the secret nobody can read or drop another request's KV."""
    with grpc.insecure_channel(stack.address("prefill")) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        with pytest.raises(grpc.RpcError) as release:
            stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(kv_handle="no-such-handle"), timeout=10)
        with pytest.raises(grpc.RpcError) as pull:
            list(stub.PullKv(prefill_pb2.PullKvRequest(kv_handle="no-such-handle"), timeout=10))
        answer = stub.ReleaseKv(
            prefill_pb2.ReleaseKvRequest(kv_handle="no-such-handle"),
            timeout=10,
            metadata=INTERNAL_AUTH_METADATA,
        )
    for refused in (release.value, pull.value):
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert MISSING_SECRET_MESSAGE in refused.details()
    assert not answer.released


def test_a_gateway_without_the_secret_gets_its_stage_calls_refused(stack, media_files, tmp_path):
    """The other side: a front door that does not know the secret cannot use the stages."""
    env = {k: v for k, v in child_env().items() if k != "EPD_INTERNAL_SECRET"}
    ports_file = tmp_path / "gateway.ports.json"
    cmd = epd_command(
        "serve",
        "gateway",
        "--port",
        "0",
        "--ports-file",
        str(ports_file),
        "--encoder",
        stack.address("encoder"),
        "--prefill",
        stack.address("prefill"),
        "--decode",
        stack.address("decode"),
    )
    with open(tmp_path / "gateway.log", "w") as log:
        gateway = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        port = bound_ports(ports_file, gateway, "the gateway", timeout_s=60)["grpc"]
        deadline = time.monotonic() + 60
        while not _serving_or_none(f"127.0.0.1:{port}"):
            assert gateway.poll() is None and time.monotonic() < deadline, (
                tmp_path / "gateway.log"
            ).read_text()
            time.sleep(0.2)
        with EpdClient(f"127.0.0.1:{port}", timeout_s=60) as client, pytest.raises(Exception) as failed:
            client.ask(media_files["png"], QUESTION, **OPTIONS)
        assert "internal secret" in str(failed.value)
    finally:
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=30)


def _serving_or_none(address: str) -> bool:
    try:
        return _serving(address)
    except grpc.RpcError:
        return False


def test_epd_serve_makes_its_own_secret_and_serves_tls_keys_and_limits(tiny_models, tmp_path, media_files):
    """One `epd serve` (the stack) with --tls-cert/--tls-key/--tls-ca/--tls-client-ca, --api-key and
    --max-requests-per-api-key: its stages take only mTLS calls carrying the stack's own secret
    (made in a 0600 file, on no command line); its gateway is TLS, takes client certificates of
    --tls-client-ca (here another CA than the stack's), the key and the per-key limit; the SDK
    and `epd ask` reach it with a client certificate, a client without one is refused; the
    launcher removes its files when it stops."""
    pki = make_pki(tmp_path)
    cert, key = pki["service"]
    ports_file = tmp_path / "stack.ports.json"
    flags = [f for name in ("gateway", "encoder", "prefill", "decode") for f in (f"--{name}-port", "0")]
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", pki["ca"], "--tls-client-ca", pki["stranger_ca"]]
    env = {k: v for k, v in child_env().items() if k not in ("EPD_INTERNAL_SECRET", "EPD_API_KEY")}
    with open(tmp_path / "stack.log", "w") as log:
        launcher = subprocess.Popen(
            epd_command(
                "serve",
                "--model",
                str(tiny_models["qwen2_vl"]),
                "--http-port",
                "0",
                "--api-key",
                API_KEY,
                "--max-requests-per-api-key",
                "3",
                *tls,
                *flags,
                "--ports-file",
                str(ports_file),
            ),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=ROOT,
        )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line.startswith("epd: stack ready"), (tmp_path / "stack.log").read_text()
        bound = json.loads(ports_file.read_text())
        ports = {
            "gateway": bound["grpc"],
            **{stage: bound[stage][0] for stage in ("encoder", "prefill", "decode")},
        }
        # The gateway is a plain child process (the stages are forked, titled by setproctitle).
        gateway = next(p for p in psutil.Process(launcher.pid).children() if "gateway" in p.cmdline())
        cmdline = gateway.cmdline()
        assert API_KEY not in " ".join(cmdline)
        assert cmdline[cmdline.index("--max-requests-per-api-key") + 1] == "3"
        secret_file = cmdline[cmdline.index("--internal-secret-file") + 1]
        assert os.stat(secret_file).st_mode & 0o077 == 0  # only this user may read it
        secret = open(secret_file).read().strip()
        assert secret not in " ".join(cmdline)
        # A stage: mTLS with a certificate of the stack's CA, and then the secret.
        stage = f"127.0.0.1:{ports['prefill']}"
        assert _get_load(stage) == grpc.StatusCode.UNAVAILABLE  # plaintext: no handshake
        assert _get_load(stage, credentials=_credentials(pki, None)) == grpc.StatusCode.UNAVAILABLE  # no cert
        client_cert = _credentials(pki, "client")
        assert MISSING_SECRET_MESSAGE in _get_load(stage, credentials=client_cert)
        assert _get_load(stage, (("x-epd-internal-auth", secret),), client_cert) == grpc.StatusCode.OK
        # The gateway: TLS, a client certificate of --tls-client-ca, then the API key.
        gateway_address = f"127.0.0.1:{ports['gateway']}"
        assert _serving(gateway_address, _credentials(pki, "stranger"))
        with pytest.raises(grpc.RpcError) as refused:
            _serving(gateway_address, _credentials(pki, None))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        stranger_cert, stranger_key = pki["stranger"]
        sdk = {
            "root_certificates_path": pki["ca"],
            "client_certificate_path": stranger_cert,
            "client_key_path": stranger_key,
        }
        with EpdClient(gateway_address, api_key=API_KEY, **sdk) as client:
            answer = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        with (
            EpdClient(gateway_address, api_key="not-the-key", **sdk) as client,
            pytest.raises(EpdError) as denied,
        ):
            client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        assert denied.value.code == grpc.StatusCode.UNAUTHENTICATED
        ask = [
            "ask",
            str(media_files["mp4"]),
            QUESTION,
            "--endpoint",
            gateway_address,
            "--api-key",
            API_KEY,
            "--num-frames",
            "4",
            "--max-new-tokens",
            "6",
            "--json",
            "--tls-ca",
            pki["ca"],
        ]
        cli = subprocess.run(
            epd_command(*ask, "--tls-cert", stranger_cert, "--tls-key", stranger_key),
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["token_ids"] == list(answer.token_ids)
        no_cert = subprocess.run(
            epd_command(*ask), capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
        )
        assert (
            no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr and "Traceback" not in no_cert.stderr
        )
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    assert not os.path.exists(secret_file) and not os.path.exists(os.path.dirname(secret_file))


@pytest.mark.parametrize("host,where", [("0.0.0.0", "on 0.0.0.0 (--host)"), ("127.0.0.1", "on loopback")])
def test_a_stage_without_the_secret_does_not_start_wherever_it_binds(host, where):
    """Off only by an explicit flag (--insecure-no-internal-auth), on loopback too."""
    env = {k: v for k, v in child_env().items() if k != "EPD_INTERNAL_SECRET"}
    proc = subprocess.run(
        epd_command("serve", "decode", "--host", host, "--port", "0"),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"epd serve decode: refusing to serve {where} without the internal secret")
    assert "--insecure-no-internal-auth" in line


def test_a_rotation_mid_rollout_serves_callers_holding_the_old_or_the_new_secret(
    tiny_models, tmp_path, media_files
):
    """Rotating the internal secret without downtime (docs/security.md): the stages already hold
    [new, old] in their secret file (decode presents the new one to prefill), while the gateway
    has not been restarted yet and presents the old one. The stack answers; each stage takes
    either secret and refuses a retired one, or an empty one, UNAUTHENTICATED."""
    import secrets

    new, old, retired = (secrets.token_hex(32) for _ in range(3))
    rotated, not_yet = tmp_path / "stages-secret", tmp_path / "gateway-secret"
    rotated.write_text(f"{new}\n{old}\n")
    not_yet.write_text(f"{old}\n")
    extra = {role: ["--internal-secret-file", str(rotated)] for role in ("encoder", "prefill", "decode")}
    extra["gateway"] = ["--internal-secret-file", str(not_yet)]
    logs = tmp_path / "logs"
    with Stack(tiny_models["qwen2_vl"], logs, extra=extra) as stack:
        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        assert result.token_ids and result.kv_num_bytes > 0  # decode pulled the KV, presenting the new one
        for stage in ("encoder", "prefill", "decode"):
            address = stack.address(stage)
            for secret in (new, old):
                assert _get_load(address, (("x-epd-internal-auth", secret),)) == grpc.StatusCode.OK
            for secret in (retired, ""):
                assert MISSING_SECRET_MESSAGE in _get_load(address, (("x-epd-internal-auth", secret),))


def _swap_in(path: Path, text: str) -> None:
    """A new file renamed over the old, as the kubelet updates a mounted Secret (a new inode)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


CHECK_INTERVAL_S = 0.25
"""The services' --secret-check-interval-s in the rotation test: each step is followed within it,
where the default 5 s made the test wait 5 s a step."""


def _until(condition, what: str, timeout_s: float = 120.0) -> None:
    """Until `condition()` holds: the services look at the file every CHECK_INTERVAL_S (a deadline
    for that, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(CHECK_INTERVAL_S)


def test_a_secret_file_rotates_in_place_without_a_restart(tiny_models, tmp_path, media_files):
    """The rotation of docs/security.md on one secret file that all four services read (as a
    mounted Kubernetes Secret, updated in place), with no restart: each step is followed by every
    service, the stack answers at every step (decode pulling KV caches from prefill too), and at
    the end the old secret is refused. A file that becomes empty, then goes, keeps the secrets read
    before (an ERROR in each log). Before, the file was read at start only: the stages never
    accepted the new secret."""
    import secrets

    old, new = (secrets.token_hex(32) for _ in range(2))
    path = tmp_path / "internal-secret"
    path.write_text(f"{old}\n")
    extra = {
        role: ["--internal-secret-file", str(path), "--secret-check-interval-s", str(CHECK_INTERVAL_S)]
        for role in ("encoder", "prefill", "decode", "gateway")
    }
    logs = tmp_path / "logs"
    stages = ("encoder", "prefill", "decode")

    def accepted(stack: Stack, secret: str) -> bool:
        return all(_get_load(stack.address(s), (("x-epd-internal-auth", secret),)) == grpc.StatusCode.OK
                   for s in stages)  # fmt: skip

    def refused(stack: Stack, secret: str) -> bool:
        return all(MISSING_SECRET_MESSAGE in str(_get_load(stack.address(s), (("x-epd-internal-auth", secret),)))
                   for s in stages)  # fmt: skip

    def logged(text: str, times: int) -> bool:
        return all((logs / f"{role}.log").read_text().count(text) >= times for role in (*stages, "gateway"))

    def ask(stack: Stack) -> None:
        with EpdClient(stack.gateway, timeout_s=120) as client:
            result = client.ask(media_files["mp4"], QUESTION, **OPTIONS)
        assert result.token_ids and result.kv_num_bytes > 0  # decode pulled the KV from prefill

    with Stack(tiny_models["qwen2_vl"], logs, extra=extra) as stack:
        ask(stack)
        assert refused(stack, new)
        _swap_in(path, f"{old}\n{new}\n")  # 1. accept the new one
        _until(lambda: accepted(stack, new) and logged("changed: now presenting", 1), "step 1 not followed")
        ask(stack)
        _swap_in(path, f"{new}\n{old}\n")  # 2. present the new one
        _until(lambda: logged("changed: now presenting", 2), "step 2 not followed")
        ask(stack)
        _swap_in(path, f"{new}\n")  # 3. retire the old one
        _until(lambda: refused(stack, old), "step 3 not followed")
        ask(stack)  # every caller presents the new one
        for times, broken in ((1, "\n"), (2, None)):  # emptied, then gone: the last good secrets stay
            if broken is None:
                path.unlink()
            else:
                _swap_in(path, broken)
            _until(lambda times=times: logged("keeping the internal secrets read before", times),
                   "an unusable file not reported")  # fmt: skip
            assert accepted(stack, new) and refused(stack, old)
            ask(stack)
        assert stack.alive()
    for role in (*stages, "gateway"):
        assert "Traceback" not in (logs / f"{role}.log").read_text()
