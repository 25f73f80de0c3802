"""Transport security settings: the flags' checks and precedence, the files' start-up checks, and
the internal secret on an in-process server (a real gRPC server on loopback, no model)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epd.cli import configs
from epd.cli.parsers.root import build_parser
from epd.stages.server_config import MAX_SECRETS, ServerConfig, TransportSecurity, read_secrets
from epd.transport import security
from epd.transport.auth import MISSING_SECRET_MESSAGE
from epd.transport.load_servicer import with_load_service
from epd.transport.server import create_server
from epd.v1 import load_pb2, load_pb2_grpc

SECRET = "0123456789abcdef0123456789abcdef"


def test_a_certificate_needs_its_key_and_mtls_needs_a_certificate():
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TransportSecurity(tls_cert="a.pem")
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        TransportSecurity(tls_client_ca="ca.pem")
    assert "internal_secret" not in repr(TransportSecurity(internal_secret=SECRET))  # never logged


def test_a_server_name_without_a_ca_is_refused_not_ignored():
    """--tls-server-name without --tls-ca left every channel plaintext, the name never checked
    (`epd health` turns the ValueError into exit 2 and one line, as for its other TLS flags)."""
    with pytest.raises(ValueError, match="--tls-server-name needs --tls-ca"):
        TransportSecurity(tls_server_name="prefill-headless")
    with pytest.raises(ValueError, match="--tls-server-name needs --tls-ca"):
        configs.health_security(
            build_parser().parse_args(["health", "127.0.0.1:1", "--tls-server-name", "gateway"])
        )
    with pytest.raises(ValueError, match="--tls-server-name needs --tls-ca"):
        configs.transport_security(build_parser().parse_args(["serve", "decode", "--tls-server-name", "p"]))


NEW, OLD, RETIRED = "n" * 32, "o" * 32, "r" * 32


def test_the_secret_file_is_checked(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        read_secrets(str(short))
    with pytest.raises(ValueError, match="cannot read it"):
        read_secrets(str(tmp_path / "missing"))
    good = tmp_path / "good"
    good.write_text(SECRET + "\n")
    assert read_secrets(str(good)) == (SECRET,)


@pytest.mark.parametrize(("text", "secrets"), [
    (f"{NEW}\n{OLD}\n", (NEW, OLD)),
    (f"\n  {NEW}  \r\n\n\t\n{OLD}", (NEW, OLD)),  # blank lines are no secrets, spaces are trimmed
])  # fmt: skip
def test_a_secret_file_holds_one_secret_a_line_the_first_presented(tmp_path, text, secrets):
    path = tmp_path / "secret"
    path.write_text(text)
    assert read_secrets(str(path)) == secrets
    args = build_parser().parse_args(["serve", "prefill", "--internal-secret-file", str(path)])
    security_of_args = configs.transport_security(args)
    assert (security_of_args.internal_secret, security_of_args.previous_internal_secrets) == (NEW, (OLD,))
    assert security_of_args.accepted_internal_secrets == (NEW, OLD)
    assert OLD not in repr(security_of_args)  # never logged


@pytest.mark.parametrize(("text", "match"), [
    ("\n \n\t\n", "holds no internal secret"),
    (f"{NEW}\nshort\n", "at least 16 characters"),
    (f"{NEW}\n{NEW}\n", "names an internal secret twice"),
    ("".join(f"{i:032d}\n" for i in range(MAX_SECRETS + 1)), f"at most {MAX_SECRETS}"),
])  # fmt: skip
def test_a_secret_file_without_a_usable_secret_on_every_line_is_refused(tmp_path, text, match):
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_secrets(str(path))


def test_the_environment_takes_several_secrets_as_the_file_does(monkeypatch):
    args = _serve_args(["decode"], monkeypatch, env_secret=f"{NEW}\n{OLD}")
    assert configs.transport_security(args).accepted_internal_secrets == (NEW, OLD)


def test_an_empty_secret_is_never_one_a_stage_accepts():
    with pytest.raises(ValueError, match="an empty internal secret is none"):
        TransportSecurity(internal_secret=NEW, previous_internal_secrets=("",))
    with pytest.raises(ValueError, match="need a current one"):
        TransportSecurity(previous_internal_secrets=(OLD,))
    assert TransportSecurity().accepted_internal_secrets == ()


def _serve_args(argv: list[str], monkeypatch, env_secret: str = ""):
    monkeypatch.delenv("EPD_INTERNAL_SECRET_FILE", raising=False)
    if env_secret:
        monkeypatch.setenv("EPD_INTERNAL_SECRET", env_secret)
    else:
        monkeypatch.delenv("EPD_INTERNAL_SECRET", raising=False)
    return build_parser().parse_args(["serve", *argv])


def test_the_file_beats_the_environment_and_the_opt_out_is_explicit(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("f" * 32)
    args = _serve_args(["prefill", "--internal-secret-file", str(path)], monkeypatch, env_secret=SECRET)
    assert configs.server_config(args).security.internal_secret == "f" * 32
    assert configs.transport_security(_serve_args(["prefill"], monkeypatch, SECRET)).internal_secret == SECRET
    opted_out = _serve_args(["prefill", "--insecure-no-internal-auth"], monkeypatch, SECRET)
    assert configs.transport_security(opted_out).internal_secret == ""
    both = _serve_args(
        ["prefill", "--insecure-no-internal-auth", "--internal-secret-file", str(path)], monkeypatch
    )
    with pytest.raises(ValueError, match="pass one of them"):
        configs.transport_security(both)


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["encoder", "--host", "0.0.0.0"], True),
        (["decode", "--host", "10.1.2.3"], True),
        (["encoder"], True),  # loopback too: every local user reaches it
        (["prefill", "--host", "::1"], True),
        (["encoder", "--insecure-no-internal-auth"], False),  # the explicit opt-out
        (["encoder", "--host", "0.0.0.0", "--insecure-no-internal-auth"], False),
        (["gateway", "--host", "0.0.0.0"], False),  # the front door has its API key
    ],
)
def test_a_stage_needs_the_secret_or_mtls_wherever_it_binds(monkeypatch, argv, refused):
    args = _serve_args(argv, monkeypatch)
    problem = configs.internal_auth_problem(args, configs.transport_security(args))
    assert (problem is not None) == refused
    if refused:
        assert "without the internal secret" in problem and "--internal-secret-file" in problem
    with_secret = _serve_args(argv, monkeypatch, env_secret=SECRET)
    assert configs.internal_auth_problem(with_secret, configs.transport_security(with_secret)) is None


def test_mtls_alone_is_enough(monkeypatch):
    args = _serve_args(
        ["prefill", "--host", "0.0.0.0", "--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"],
        monkeypatch,
    )
    assert configs.internal_auth_problem(args, configs.transport_security(args)) is None


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    leaf, other = ca.issue_cert("localhost"), ca.issue_cert("other")
    leaf.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(d / "key.pem"))
    other.private_key_pem.write_to_path(str(d / "other.key"))
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    (d / "not.pem").write_text("hello")
    return d


def test_unusable_tls_files_are_one_line_errors(pki):
    mismatched = TransportSecurity(tls_cert=str(pki / "cert.pem"), tls_key=str(pki / "other.key"))
    with pytest.raises(ValueError, match="not a certificate and its matching key"):
        security.check_files(mismatched)
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM file"):
        security.check_files(TransportSecurity(tls_ca=str(pki / "not.pem")))
    (pki / "broken-ca.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="--tls-ca .*not a PEM CA bundle"):
        security.check_files(TransportSecurity(tls_ca=str(pki / "broken-ca.pem")))
    # A missing CA file is named as missing, as a missing certificate is (not "not a PEM CA bundle").
    with pytest.raises(
        ValueError, match=r"^--tls-ca /missing/ca\.pem: cannot read it \(No such file or directory\)$"
    ):
        security.check_files(TransportSecurity(tls_ca="/missing/ca.pem"))
    with pytest.raises(ValueError, match=r"--tls-key .*not a PEM file"):
        security.server_credentials(
            TransportSecurity(tls_cert=str(pki / "cert.pem"), tls_key=str(pki / "not.pem"))
        )
    good = TransportSecurity(
        tls_cert=str(pki / "cert.pem"), tls_key=str(pki / "key.pem"), tls_client_ca=str(pki / "ca.pem")
    )
    security.check_files(good)
    assert security.server_ssl_context(good) is not None  # the HTTP port's context


def test_a_stage_with_a_secret_refuses_calls_without_it_but_answers_health():
    async def run():
        config = ServerConfig(security=TransportSecurity(internal_secret=SECRET))
        hs = await create_server(config, with_load_service(lambda s: None, lambda: []), ["epd.v1.Test"])
        await hs.set_serving()
        address = f"127.0.0.1:{hs.port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=5)
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            security.configure(TransportSecurity(internal_secret=SECRET))  # what a gateway does
            try:
                async with security.stage_channel(address) as channel:
                    await load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=5)
            finally:
                security.configure(TransportSecurity())
        finally:
            await hs.stop(0)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert refused.value.details().startswith(MISSING_SECRET_MESSAGE)
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    asyncio.run(run())


def test_a_refused_stream_of_junk_bytes_is_unauthenticated_not_a_parse_error():
    """A caller without the secret is refused before its messages are read as protobuf: a request
    stream of bytes that do not parse (prefill's `Prefill`, a real servicer) gets UNAUTHENTICATED,
    not gRPC's UNKNOWN naming the DecodeError that parsing them for the drain raised."""
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.kv_store import KvStore
    from epd.prefill_svc.servicer import PrefillServicer
    from epd.v1 import prefill_pb2_grpc

    def register(server: grpc.aio.Server) -> None:
        servicer = PrefillServicer(PrefillConfig(), KvStore(1 << 20, 60.0))
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)

    async def run() -> grpc.aio.AioRpcError:
        config = ServerConfig(security=TransportSecurity(internal_secret=SECRET))
        hs = await create_server(config, register, ["epd.v1.PrefillService"])
        await hs.set_serving()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                prefill = channel.stream_unary("/epd.v1.PrefillService/Prefill")  # bytes as they are
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await prefill(iter([b"\x0a\xff"]), timeout=5)  # field 1, a length past the end
                return refused.value
        finally:
            await hs.stop(0)

    refused = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused.details()
    assert refused.details().startswith(MISSING_SECRET_MESSAGE)


def test_a_stage_mid_rotation_accepts_the_new_and_the_old_secret_and_refuses_a_retired_one():
    """A stage configured with [new, old] (its secret file's lines) takes calls from callers that
    present either (those restarted with the new file and those not yet); a secret already retired,
    an empty one, or none is refused UNAUTHENTICATED."""

    async def run():
        config = ServerConfig(
            security=TransportSecurity(internal_secret=NEW, previous_internal_secrets=(OLD,))
        )
        hs = await create_server(config, with_load_service(lambda s: None, lambda: []), ["epd.v1.Test"])
        await hs.set_serving()
        answers = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                for name, metadata in (
                    ("new", NEW),
                    ("old", OLD),
                    ("retired", RETIRED),
                    ("empty", ""),
                    ("none", None),
                ):
                    try:
                        await load_pb2_grpc.LoadServiceStub(channel).GetLoad(
                            load_pb2.GetLoadRequest(),
                            timeout=5,
                            metadata=None if metadata is None else (("x-epd-internal-auth", metadata),),
                        )
                        answers[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as exc:
                        answers[name] = exc.code()
            for presented in (NEW, OLD):  # what a gateway (or decoder) with that file first presents
                security.configure(TransportSecurity(internal_secret=presented))
                try:
                    async with security.stage_channel(f"127.0.0.1:{hs.port}") as channel:
                        await load_pb2_grpc.LoadServiceStub(channel).GetLoad(
                            load_pb2.GetLoadRequest(), timeout=5
                        )
                finally:
                    security.configure(TransportSecurity())
        finally:
            await hs.stop(0)
        return answers

    answers = asyncio.run(run())
    assert answers == {"new": grpc.StatusCode.OK, "old": grpc.StatusCode.OK,
                       "retired": grpc.StatusCode.UNAUTHENTICATED, "empty": grpc.StatusCode.UNAUTHENTICATED,
                       "none": grpc.StatusCode.UNAUTHENTICATED}  # fmt: skip


def test_the_gateway_does_not_ask_its_clients_for_the_secret():
    async def run():
        config = ServerConfig(security=TransportSecurity(internal_secret=SECRET))
        hs = await create_server(config, with_load_service(lambda s: None, lambda: []), [], public=True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{hs.port}") as channel:
                await load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=5)
        finally:
            await hs.stop(0)

    asyncio.run(run())
