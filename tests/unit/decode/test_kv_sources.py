"""`--allow-kv-from`: a client-given KV address is parsed as one HOST:PORT, compared by value with
the operator's parsed entries, and dialled as the target built from the parsed parts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import re

import grpc
import pytest

from epd.cli.parsers.root import build_parser
from epd.decode_svc import kv_pull
from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.kv_pull import KvPuller
from epd.stages.errors import InvalidRequest, KvSourceLost
from epd.stages.server_config import ServerConfig
from epd.transport.ports_file import free_port
from epd.transport.server import create_server
from epd.v1 import prefill_pb2, prefill_pb2_grpc

DEFAULT = DecodeConfig().allow_kv_from  # 127.0.0.1:*, localhost:*, [::1]:*
K8S = ("10.0.0.0/8:50052", "172.16.0.0/12:50052", "192.168.0.0/16:50052")  # deploy/k8s/decode.yaml


def _admits(allowed: tuple[str, ...], address: str) -> bool:
    try:
        KvPuller(allowed, 1, 1.0).check_allowed(address)
    except InvalidRequest:
        return False
    return True


@pytest.mark.parametrize(
    "allowed, address, admitted",
    [
        # the loopback defaults
        (DEFAULT, "127.0.0.1:50052", True),
        (DEFAULT, "[::1]:50052", True),
        (DEFAULT, "[0:0:0:0:0:0:0:1]:50052", True),  # IP literals compare by value
        (DEFAULT, "localhost:50052", True),
        (DEFAULT, "LocalHost.:50052", True),
        # IPv4-mapped / bare IPv6: gRPC dials ::ffff:a00:5 as 10.0.0.5:443 (a character class
        # pattern once admitted it); mapped forms never equal an allowed IPv4 entry
        (DEFAULT, "::ffff:a00:5", False),
        (DEFAULT, "::ffff:7f00:1", False),
        (DEFAULT, "[::ffff:7f00:1]:50052", False),
        (DEFAULT, "[::ffff:127.0.0.1]:50052", False),
        # not one HOST:PORT: schemes, lists, paths, missing or bad ports, resolver-only numerics
        (DEFAULT, "ipv4:127.0.0.1:1", False),
        (DEFAULT, "ipv6:[::1]:1", False),
        (DEFAULT, "dns:///x:1", False),
        (DEFAULT, "dns:///localhost:50052", False),
        (DEFAULT, "unix:/tmp/s", False),
        (DEFAULT, "127.0.0.1:1,10.0.0.5:2", False),
        (DEFAULT, "127.0.0.1:50052/x", False),
        (DEFAULT, "localhost", False),
        (DEFAULT, "127.0.0.1:99999", False),
        (DEFAULT, "127.0.0.1:0", False),
        (DEFAULT, "127.0.0.1:", False),
        (DEFAULT, "127.1:50052", False),
        (DEFAULT, "0x7f000001:50052", False),
        (DEFAULT, "[::1%lo]:50052", False),
        (DEFAULT, " 127.0.0.1:50052", False),
        (DEFAULT, "10.0.0.5:50052", False),
        # a port-pinned entry over a network (what the k8s decoders use): the evil hosts an
        # fnmatch `*:50052` admitted are refused
        (K8S, "10.244.3.17:50052", True),
        (K8S, "10.244.3.17:22", False),
        (K8S, "evil.example:50052", False),
        (K8S, "evil.example:1,10.0.0.5:50052", False),
        (K8S, "evil.example/x:50052", False),
        (K8S, "[::ffff:a00:5]:50052", False),
        (K8S, "127.0.0.1:50052", False),
        # exact names: no suffix or prefix matching
        (("prefill:50052",), "prefill:50052", True),
        (("prefill:50052",), "PREFILL:50052", True),
        (("prefill:50052",), "prefill:50053", False),
        (("prefill:50052",), "prefill.evil.example:50052", False),
        (("prefill:50052",), "evilprefill:50052", False),
        (("[fd00::/8]:*",), "[fd12::1]:9", True),
        (("[fd00::/8]:*",), "[fe80::1]:9", False),
    ],
)
def test_allow_list(allowed, address, admitted):
    assert _admits(allowed, address) is admitted


@pytest.mark.parametrize(
    "entry, reason",
    [
        ("*:50052", "no any-host wildcard"),
        ("*", "needs a :PORT"),
        ("*:*", "no any-host wildcard"),
        ("prefill", "needs a :PORT"),
        ("prefill:99999", "1..65535"),
        ("prefill:5005*", "1..65535"),
        ("10.244.3.17/16:50052", "host bits set"),
        ("10.244.*:50052", "not a DNS name"),
        ("::1:*", "in brackets"),
        ("[10.0.0.1]:1", "only IPv6 addresses go in brackets"),
        ("ipv4:127.0.0.1:*", "no scheme"),
        ("127.0.0.1:1,10.0.0.5:2", "no scheme"),
        ("[::1:*", "[ADDRESS]:PORT"),
    ],
)
def test_bad_operator_entries_are_refused_at_config_time(entry, reason):
    with pytest.raises(ValueError, match=r"--allow-kv-from entry .*" + re.escape(reason)):
        DecodeConfig(allow_kv_from=(entry,))


def test_cli_refuses_a_bad_entry_with_a_usage_error():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "decode", "--allow-kv-from", "127.0.0.1:*,*:50052"])
    assert "argument --allow-kv-from: --allow-kv-from entry '*:50052' is not valid" in err.getvalue()
    args: argparse.Namespace = build_parser().parse_args(["serve", "decode"])
    assert args.allow_kv_from == ("127.0.0.1:*", "localhost:*", "[::1]:*")


def test_refused_address_raises_before_any_channel_is_made(monkeypatch):
    def no_channel(*args, **kwargs):
        raise AssertionError(f"a channel was made to {args[0]!r}")

    monkeypatch.setattr(grpc.aio, "insecure_channel", no_channel)
    puller = KvPuller(DEFAULT, 1 << 20, 1.0)
    for address in ("::ffff:a00:5", "10.0.0.5:50052", "127.0.0.1:1,10.0.0.5:2"):
        with pytest.raises(InvalidRequest, match="allow-kv-from|not one HOST:PORT"):
            asyncio.run(puller.pull(address, "handle"))


@pytest.mark.parametrize(
    "address, target",
    [
        ("127.0.0.1:{port}", "ipv4:127.0.0.1:{port}"),
        ("localhost:{port}", "dns:///localhost:{port}"),
        ("[0:0:0:0:0:0:0:1]:{port}", "ipv6:[::1]:{port}"),
    ],
)
def test_the_target_dialled_is_built_from_the_parsed_address(address, target):
    """A real loopback server with no PrefillService: UNIMPLEMENTED proves the pull reached it."""
    puller = KvPuller(DEFAULT, 1 << 20, 5.0)
    host = "[::1]" if address.startswith("[") else "127.0.0.1"

    async def run() -> grpc.StatusCode:
        try:
            hs = await create_server(ServerConfig(host=host, port=0), lambda s: None, [])
        except OSError:
            pytest.skip(f"cannot bind {host} here")
        try:
            assert puller.check_allowed(address.format(port=hs.port)).grpc_target == target.format(
                port=hs.port
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await puller.pull(address.format(port=hs.port), "handle")
            return info.value.code()
        finally:
            await puller.close()
            await hs.stop(0)

    assert asyncio.run(run()) == grpc.StatusCode.UNIMPLEMENTED


class _HangingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """A pull that stays in flight until cancelled."""

    async def PullKv(self, request, context):
        await asyncio.sleep(60)
        yield prefill_pb2.KvChunk()


def test_idle_channels_are_bounded_and_one_in_use_is_kept(monkeypatch):
    """Each request names its KV address: a channel kept for every address ever named grew without
    bound (one per port the allow-list admits). Beyond the bound the least recently used idle ones
    close; a channel with a pull in flight is never closed under it."""
    monkeypatch.setattr(kv_pull, "MAX_IDLE_CHANNELS", 2)
    puller = KvPuller(DEFAULT, 1 << 20, 5.0)

    async def run():
        hs = await create_server(
            ServerConfig(host="127.0.0.1", port=0),
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(_HangingPrefill(), s),
            [],
        )
        try:
            busy = f"127.0.0.1:{hs.port}"
            pull = asyncio.ensure_future(puller.pull(busy, "handle"))
            while not puller.channels.targets:
                await asyncio.sleep(0.01)
            refused = [f"127.0.0.1:{free_port()}" for _ in range(5)]  # nothing listens there
            for address in refused:
                with pytest.raises(KvSourceLost):
                    await puller.pull(address, "handle")
            kept = puller.channels.targets
            still_pulling = not pull.done()
            pull.cancel()
            await asyncio.gather(pull, return_exceptions=True)
            return busy, refused, kept, still_pulling
        finally:
            await puller.close()
            await hs.stop(0)

    busy, refused, kept, still_pulling = asyncio.run(run())
    assert still_pulling, "the pull in flight was not cut by the closing of idle channels"
    targets = [puller.check_allowed(a).grpc_target for a in (busy, *refused)]
    # The busy one, the two most recent idle ones and the last one used (closed at the next call).
    assert kept == [targets[0], *targets[-3:]]
