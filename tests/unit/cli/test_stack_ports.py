"""The ports of `epd serve`'s children (epd/cli/stack_commands.py): one replica per stage keeps the
stage's port, replicas get their own (port 0: a free one each, the gateway given those they bound),
the gateway lists them all, and ports that clash are a usage error before anything starts."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_USAGE
from epd.cli.stack_commands import port_clash, replica_ports, stack_commands
from tests.unit.cli.stack_args import _parsed


def test_one_replica_per_stage_keeps_the_stage_ports():
    args = build_parser().parse_args(["serve"])
    args.model = "/m"
    commands = stack_commands(args)
    assert sorted(commands) == ["decode[0]", "encoder[0]", "gateway", "prefill[0]"]
    assert [_parsed(commands[f"{r}[0]"]).port for r in ("encoder", "prefill", "decode")] == [
        50051,
        50052,
        50053,
    ]
    gateway = configs.gateway_config(_parsed(commands["gateway"]))
    assert (gateway.encoder_addresses, gateway.prefill_addresses, gateway.decode_addresses) == (
        ("127.0.0.1:50051",),
        ("127.0.0.1:50052",),
        ("127.0.0.1:50053",),
    )


def test_replicas_get_their_own_ports_and_the_gateway_lists_them_all():
    args = build_parser().parse_args(
        ["serve", "--encoders", "3", "--prefills", "2", "--decodes", "2", "--decode-port", "6000"]
    )
    args.model = "/m"
    commands = stack_commands(args)
    assert replica_ports(args) == {
        "encoder": [50051, 50061, 50071],
        "prefill": [50052, 50062],
        "decode": [6000, 6010],
    }
    assert port_clash(args) is None
    gateway = configs.gateway_config(_parsed(commands["gateway"]))
    assert gateway.encoder_addresses == ("127.0.0.1:50051", "127.0.0.1:50061", "127.0.0.1:50071")
    assert gateway.prefill_addresses == ("127.0.0.1:50052", "127.0.0.1:50062")
    assert gateway.decode_addresses == ("127.0.0.1:6000", "127.0.0.1:6010")
    for role, ports in replica_ports(args).items():
        for i, port in enumerate(ports):
            replica = _parsed(commands[f"{role}[{i}]"])
            assert (replica.role, replica.port) == (role, port)
            if role == "prefill":  # advertises its own address: decoders pull from the replica that prefilled
                assert configs.prefill_config(replica).advertise_address == ""
            if role == "decode":  # the default allow-list admits every loopback prefill replica
                allowed = configs.decode_config(replica).allow_kv_from
                assert "127.0.0.1:*" in allowed


def test_port_0_is_a_free_port_for_each_replica_and_the_gateway_gets_those_they_bound():
    """Port 0 (and --http-port auto) clash with nothing: each replica binds a free port of its
    own; the launcher gives the gateway the ports they bound (`stack_commands(args, bound)`)."""
    argv = ["serve", "--encoders", "2", "--encoder-port", "0", "--gateway-port", "0", "--http-port", "auto"]
    args = build_parser().parse_args(argv)
    args.model = "/m"
    assert replica_ports(args) == {"encoder": [0, 0], "prefill": [50052], "decode": [50053]}
    assert port_clash(args) is None
    assert [_parsed(stack_commands(args)[f"encoder[{i}]"]).port for i in (0, 1)] == [0, 0]
    bound = {"encoder": [41001, 41002], "prefill": [50052], "decode": [50053]}
    gateway = configs.gateway_config(_parsed(stack_commands(args, bound)["gateway"]))
    assert gateway.encoder_addresses == ("127.0.0.1:41001", "127.0.0.1:41002")
    assert (gateway.server.port, gateway.http.port) == (0, 0)  # auto: a free port


@pytest.mark.parametrize(
    "argv, problem",
    [
        (
            ["--encoders", "2", "--encoder-port", "50042"],
            "prefill[0] would listen on port 50052, which encoder[1] uses",
        ),
        (["--decodes", "3", "--decode-port", "65530"], "decode[1] would listen on port 65540"),
        (["--http-port", "50050"], "--http-port 50050 is also --gateway-port"),
        (["--http-port", "50061", "--encoders", "2"], "which the gateway's HTTP API uses"),
    ],
)
def test_ports_that_clash_are_a_usage_error_before_anything_starts(argv, problem, capsys):
    args = build_parser().parse_args(["serve", *argv])
    assert problem in (port_clash(args) or "")
    from epd.cli.launcher import serve_stack

    assert serve_stack(args) == EXIT_USAGE
    assert problem in capsys.readouterr().err
