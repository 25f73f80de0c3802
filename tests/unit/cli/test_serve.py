"""`epd serve`'s launcher before it starts anything: the model check, the children's command
lines, and no torch (the real processes are in tests/integration/test_lifecycle.py)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from epd.cli import configs
from epd.cli.flags.gateway import GATEWAY_FLAGS
from epd.cli.flags.stages import STAGE_FLAGS
from epd.cli.launcher import serve_stack
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_MODEL, EXIT_USAGE
from epd.cli.stack_commands import (
    check_max_model_len,
    flag_words,
    gateway_flags,
    port_clash,
    replica_ports,
    stack_commands,
    stage_flag_problem,
    stage_flags,
)
from epd.decode_svc.config import DecodeConfig
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.config import GatewayConfig, HttpApiConfig, MediaFetchConfig
from epd.model_runtime.loader import ModelLoadError, check_model_dir
from epd.prefill_svc.config import PrefillConfig
from epd.resources import demo_model_dir
from epd.stages.server_config import ServerConfig
from epd.transport import convert
from epd.transport.errors import status_of
from epd.v1 import common_pb2
from epd.video.types import SamplingOptions
from tests.stack import ROOT, child_env


def _safetensors(path: Path, data_bytes: int, written_bytes: int | None = None) -> None:
    """A safetensors file of one float32 tensor: 8-byte header length, JSON header, data."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}}
    ).encode()
    body = bytes(data_bytes if written_bytes is None else written_bytes)
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


def _checkpoint(root: Path, model_type: str = "qwen2_vl") -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_the_shipped_model_passes_the_check():
    assert check_model_dir(str(demo_model_dir())) in ("qwen2_vl", "qwen2_5_vl")


def test_sharded_weights_are_checked_shard_by_shard(tmp_path):
    root = _checkpoint(tmp_path / "m")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _safetensors(root / "model-1.safetensors", 64)
    with pytest.raises(
        ModelLoadError, match="model-2.safetensors named in model.safetensors.index.json is missing"
    ):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64, written_bytes=60)
    with pytest.raises(ModelLoadError, match="model-2.safetensors is truncated or corrupt"):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64)
    assert check_model_dir(str(root)) == "qwen2_vl"


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "truncated or corrupt"),  # empty
        (struct.pack("<Q", 1 << 40) + b"{}", "truncated or corrupt"),  # header longer than the file
        (struct.pack("<Q", 5) + b"nope!", "truncated or corrupt"),  # header not JSON
    ],
)
def test_unreadable_safetensors_headers_are_refused(tmp_path, content, reason):
    root = _checkpoint(tmp_path / "m")
    (root / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadError, match=reason):
        check_model_dir(str(root))


def test_config_problems_name_the_file(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        check_model_dir(str(root))
    (root / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        check_model_dir(str(root))
    with pytest.raises(ModelLoadError, match="no such directory"):
        check_model_dir(str(tmp_path / "absent" / "dir"))
    assert check_model_dir("Qwen/Qwen2-VL-2B-Instruct") is None  # a hub id: only loading can check it


def test_a_model_that_cannot_load_is_a_failed_precondition_without_its_path():
    """What a service answers instead of INTERNAL; the path and the reason are the server log's
    (`rpc_errors`), not the client's: they reached clients with the status."""
    code, message = status_of(ModelLoadError("/srv/m", "model_type 'llama' is not supported; epd serves X"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert message == "the server cannot load its model; its operator must fix it (the server log says why)"


def test_grace_period_reaches_every_service():
    args = build_parser().parse_args(["serve", "--grace-period", "7.5"])
    args.model = "/m"
    for name, command in stack_commands(args).items():
        assert command[command.index("--grace-period") + 1] == "7.5", name
        role = build_parser().parse_args(command[command.index("serve") :])
        assert configs.server_config(role).grace_s == 7.5
    assert build_parser().parse_args(["serve", "decode"]).grace_period == 30.0


def test_close_timeout_reaches_every_service_and_the_colocated_stages():
    """--close-timeout-s (the threads' one deadline after the drain) reaches the stack's every
    service's config, and the colocated front door's, whose embedded pipeline closes with it
    (`serve._colocated`); the launcher's kill wait grows with it (`stop_wait_s`). The default is
    the model thread's own (30 s)."""
    from epd.cli.launcher import stop_wait_s
    from epd.stages.model_thread import CLOSE_WAIT_S

    args = build_parser().parse_args(["serve", "--close-timeout-s", "4.5"])
    args.model = "/m"
    for name, command in stack_commands(args).items():
        assert command[command.index("--close-timeout-s") + 1] == "4.5", name
        role = build_parser().parse_args(command[command.index("serve") :])
        assert configs.server_config(role).close_timeout_s == 4.5, name
    colocated = build_parser().parse_args(["serve", "--colocate", "--close-timeout-s", "4.5"])
    assert configs.colocated_gateway_config(colocated).server.close_timeout_s == 4.5
    assert stop_wait_s(0.0, 60.0) - stop_wait_s(0.0, 30.0) == 30.0
    for argv in (["serve", "decode"], ["ask", "v.mp4", "q?"]):
        assert build_parser().parse_args(argv).close_timeout_s == CLOSE_WAIT_S
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "prefill", "--close-timeout-s", "-1"])


def test_the_colocated_pipeline_closes_within_close_timeout(tiny_models, monkeypatch):
    """`epd serve --colocate --close-timeout-s S`: the embedded pipeline the front door closes
    after its drain (`Pipeline.aclose`) has S as its close's one deadline, not the default. The
    front door itself is not started here: what it is handed is kept and closed."""
    import asyncio

    from epd.cli import serve
    from epd.gateway import server as gateway

    handed = []

    async def main(config, local=None):
        handed.append(local)

    monkeypatch.setattr(gateway, "main", main)
    argv = ["serve", "--colocate", "--model", str(tiny_models["qwen2_vl"]), "--close-timeout-s", "4.5"]
    args = build_parser().parse_args(argv)
    asyncio.run(serve._colocated(configs.colocated_gateway_config(args), configs.colocated_stages(args)))
    [pipeline] = handed
    try:
        assert pipeline.close_timeout_s == 4.5
    finally:
        pipeline.close()


def test_the_prefix_cache_flags_reach_the_stacks_prefill():
    args = build_parser().parse_args(["serve", "--prefix-cache-bytes", "0", "--prefix-cache-ttl", "5"])
    args.model = "/m"
    command = stack_commands(args)["prefill[0]"]
    role = build_parser().parse_args(command[command.index("serve") :])
    config = configs.prefill_config(role)
    assert (config.prefix_cache_bytes, config.prefix_cache_ttl_s) == (0, 5.0)
    assert "--prefix-cache-bytes" not in stack_commands(args)["encoder[0]"]


def test_the_linear_kernel_reaches_every_model_service():
    args = build_parser().parse_args(["serve", "--linear-kernel", "onednn"])
    args.model = "/m"
    makers = {
        "encoder": configs.encoder_config,
        "prefill": configs.prefill_config,
        "decode": configs.decode_config,
    }
    for name, command in stack_commands(args).items():
        role = name.split("[")[0]
        if role in makers:
            assert makers[role](_parsed(command)).model.linear_kernel == "onednn", name
    plain = build_parser().parse_args(["serve", "--colocate"])
    plain.model = "/m"
    assert configs.model_config(plain).linear_kernel == "torch"


def test_the_structured_compile_timeout_reaches_the_services_that_compile():
    args = build_parser().parse_args(["serve", "--structured-compile-timeout-s", "2.5"])
    args.model = "/m"
    makers = {"prefill": configs.prefill_config, "decode": configs.decode_config}
    for name, command in stack_commands(args).items():
        role = name.split("[")[0]
        if role in makers:
            assert makers[role](_parsed(command)).model.structured_compile_timeout_s == 2.5, name
        else:  # the encoder compiles none (nor does the gateway, which has no model flags)
            assert "--structured-compile-timeout-s" not in command, name
    plain = build_parser().parse_args(["serve", "--colocate"])
    plain.model = "/m"
    assert configs.model_config(plain).structured_compile_timeout_s == 30.0


@pytest.mark.parametrize(
    "argv",
    [["serve", "prefill"], ["serve", "decode"], ["serve"], ["serve", "--colocate"], ["ask", "v.mp4", "q?"]],
)
def test_the_structured_compile_timeout_is_a_flag_of_what_compiles(argv):
    """Prefill, decode, the stack (which passes it to them), the colocated stages and `epd ask`'s
    embedded ones compile structured outputs, and take their deadline."""
    args = build_parser().parse_args([*argv, "--structured-compile-timeout-s", "5"])
    args.model = "/m"
    assert configs.model_config(args).structured_compile_timeout_s == 5.0


def test_the_encoder_has_no_structured_compile_timeout(capsys):
    """The encoder never compiles a grammar: the flag was taken and silently unused."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "encoder", "--structured-compile-timeout-s", "5"])
    assert info.value.code == 2
    assert "unrecognized arguments: --structured-compile-timeout-s 5" in capsys.readouterr().err


def test_the_log_format_reaches_every_service():
    args = build_parser().parse_args(["--log-format", "json", "serve"])
    args.model = "/m"
    for name, command in stack_commands(args).items():
        assert build_parser().parse_args(command[3:]).log_format == "json", name
    text = build_parser().parse_args(["serve"])
    text.model = "/m"
    # the default, titles stay short
    assert all("--log-format" not in c for c in stack_commands(text).values())


def test_the_kv_ttl_and_the_attempt_timeout_reach_prefill_and_the_gateway():
    args = build_parser().parse_args(
        ["serve", "--prefills", "2", "--kv-ttl", "7", "--stage-attempt-timeout", "3"]
    )
    args.model = "/m"
    commands = stack_commands(args)
    for name in ("prefill[0]", "prefill[1]"):
        assert configs.prefill_config(_parsed(commands[name])).kv_ttl_s == 7.0
    gateway = _parsed(commands["gateway"])
    assert configs.gateway_config(gateway).stage_attempt_timeout_s == 3.0
    assert "--kv-ttl" not in commands["encoder[0]"]


def _parsed(command: list[str]):
    return build_parser().parse_args(command[command.index("serve") :])


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


@pytest.mark.parametrize("word, port", [("0", None), ("auto", 0), ("AUTO", 0), ("8000", 8000)])
def test_http_port_0_is_off_and_auto_a_free_port(word, port, tmp_path):
    ports_file = str(tmp_path / "ports.json")
    argv = ["serve", "gateway", "--http-port", word, "--ports-file", ports_file]
    config = configs.gateway_config(build_parser().parse_args(argv))
    assert (config.http.port, config.server.ports_file) == (port, ports_file)


def test_an_http_port_neither_a_number_nor_auto_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "gateway", "--http-port", "any"])
    assert "--http-port" in capsys.readouterr().err


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--encoders", "0"], "must be 1 to 64 replicas"),
        (["--decodes", "two"], "expected a number of replicas"),
        (["--health-timeout", "0"], "must be > 0 seconds"),
        (["--health-timeout", "-3"], "must be >= 0 seconds"),
    ],
)
def test_bad_replica_and_health_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_replica_and_health_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.encoders, args.prefills, args.decodes, args.health_timeout) == (1, 1, 1, 10.0)


@pytest.mark.parametrize("close_timeout_s", [0.0, 2.0, 30.0, 120.0])
def test_the_launcher_waits_for_what_a_service_closes_after_its_drain(close_timeout_s):
    """The launcher SIGKILLs a service `stop_wait_s(--grace-period, --close-timeout-s)` after its
    SIGTERM: that must cover every service's stop, added up from the code's bounds
    (`_BEFORE_CLOSE_S` and `_GATEWAY_AFTER_DRAIN_S` are written out: the bounds' modules load
    torch; 5 s in all, before, cut a stage's 30 s close deadline short)."""
    from epd.cli import launcher
    from tests.unit.deploy.epd_commands import stop_bound_s

    for role in ("gateway", "encoder", "prefill", "decode"):
        assert launcher.stop_wait_s(30.0, close_timeout_s) >= stop_bound_s(role, 30.0, close_timeout_s), role


def test_a_negative_grace_period_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "encoder", "--grace-period", "-1"])
    assert "must be >= 0 seconds" in capsys.readouterr().err


def test_the_launcher_imports_no_torch():
    """Everything `epd serve` does before it spawns the services, in a fresh interpreter: parse,
    find the shipped default model, check it, build the children's command lines."""
    code = """
import sys
from epd.cli import serve
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stack_commands
from epd.model_runtime.loader import check_model_dir, resolve_model_path
args = build_parser().parse_args(["serve"])
args.model = resolve_model_path(args.model)
check_model_dir(args.model)
stack_commands(args)
print(args.model, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    env = {k: v for k, v in child_env().items() if k not in ("EPD_MODEL", "EPD_DEFAULT_MODEL")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(demo_model_dir()), "[]"]


class _Process:
    """A child as the launcher sees it (`poll`, `pid`, `kill`, ...), that exits with `code` after
    being polled `polls` times: the supervision loop's processes, without starting any."""

    pids = iter(range(1000, 2000))

    def __init__(self, code: int | None = None, polls: int = 0) -> None:
        self.pid, self._code, self._polls, self.returncode = next(self.pids), code, polls, None

    def poll(self) -> int | None:
        if self.returncode is None and self._code is not None:
            self._polls -= 1
            if self._polls < 0:
                self.returncode = self._code
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def send_signal(self, signum: int) -> None:
        self.returncode = -signum

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@pytest.fixture
def health_servers():
    """Real grpc.health servers answering SERVING on free loopback ports: what the supervisor asks."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servers = []
    pools = []

    def serve() -> int:
        pools.append(futures.ThreadPoolExecutor(max_workers=2))
        server = grpc.server(pools[-1])
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return port

    yield serve
    for server in servers:
        server.stop(None)
    for pool in pools:  # the server's stop leaves its pool's threads to their owner
        pool.shutdown()


@pytest.fixture
def launcher_signals():
    import signal

    from epd.cli.launcher import _Signals

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = _Signals()
    # A supervisor that never decides is stopped as Ctrl-C would (and the test then fails on EXIT_OK).
    timer = threading.Timer(30.0, signals.stop.set)
    timer.start()
    yield signals
    timer.cancel()
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])


def _slots(serve, names: list[str], policy):
    import time

    from epd.cli.launcher import _Slot
    from epd.cli.supervisor import Replica

    return [
        _Slot(name, name.partition("[")[0], serve(), [], Replica(name, policy, time.monotonic()))
        for name in names
    ]


def test_crash_looping_replicas_are_given_up_and_the_stack_stops_with_its_last_one(
    health_servers, launcher_signals, capsys
):
    from epd.cli.launcher import _supervise
    from epd.cli.process_exit import EXIT_FAILED
    from epd.cli.supervisor import RestartPolicy, State

    policy = RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.01, crash_loop_exits=2)
    slots = _slots(health_servers, ["gateway", "encoder[0]", "encoder[1]"], policy)
    started: list[str] = []

    def start(slot):
        started.append(slot.name)
        # The gateway runs; each encoder process dies (code 1) soon after it starts, encoder[0]'s later.
        return (
            _Process() if slot.role == "gateway" else _Process(1, polls=2 if slot.name == "encoder[1]" else 7)
        )

    for slot in slots:
        slot.proc = start(slot)
    assert _supervise(slots, start, launcher_signals, policy, ready_timeout_s=30) == EXIT_FAILED
    err = capsys.readouterr().err.splitlines()
    exits = [line.split(") ", 1)[1] for line in err if line.startswith("epd: encoder[1] (pid ")]
    assert exits == [
        "exited with code 1; restarting in 0.01 s",
        "exited with code 1; crash-looping (2 exits in 60 s); giving up on it",
    ], err
    assert "epd: encoder[1] restarted (pid " in "\n".join(err)
    assert err[-1] == "epd: no encoder left; stopping the stack", err
    assert [s.replica.state for s in slots] == [State.SERVING, State.GIVEN_UP, State.GIVEN_UP]
    assert started.count("encoder[0]") == started.count("encoder[1]") == 2 and started.count("gateway") == 1


@pytest.mark.parametrize("code", [3, 2])  # EXIT_MODEL, EXIT_USAGE: a restart would fail the same way
def test_a_replica_that_cannot_load_its_model_stops_the_stack_without_a_restart(
    health_servers, launcher_signals, code
):
    from epd.cli.launcher import _supervise
    from epd.cli.supervisor import RestartPolicy

    policy = RestartPolicy(backoff_initial_s=0.01)
    slots = _slots(health_servers, ["gateway", "decode[0]"], policy)
    started: list[str] = []

    def start(slot):
        started.append(slot.name)
        return _Process() if slot.role == "gateway" else _Process(code, polls=3)

    for slot in slots:
        slot.proc = start(slot)
    assert _supervise(slots, start, launcher_signals, policy, ready_timeout_s=30) == code
    assert started == ["gateway", "decode[0]"]


def test_the_batching_flags_reach_the_stacks_stages_and_the_colocated_ones():
    """`epd serve --max-prefill-tokens-per-step/--prefill-chunk-tokens/--max-running-requests`
    (vLLM's --max-num-batched-tokens / --max-num-seqs): the stack passes them to its prefill and
    decode, --colocate builds its stages with them; a bad value is a usage error before start."""
    flags = [
        "--max-prefill-tokens-per-step",
        "1024",
        "--prefill-chunk-tokens",
        "256",
        "--max-running-requests",
        "6",
    ]
    args = build_parser().parse_args(["serve", *flags])
    args.model = "/m"
    commands = stack_commands(args)
    prefill = configs.prefill_config(
        build_parser().parse_args(commands["prefill[0]"][commands["prefill[0]"].index("serve") :])
    )
    assert (prefill.scheduler.max_prefill_tokens_per_step, prefill.scheduler.prefill_chunk_tokens) == (
        1024,
        256,
    )
    decode = configs.decode_config(
        build_parser().parse_args(commands["decode[0]"][commands["decode[0]"].index("serve") :])
    )
    assert decode.max_running_requests == 6
    assert "--max-running-requests" not in commands["encoder[0]"]

    colocated = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate", *flags]))
    assert colocated.prefill.scheduler.max_prefill_tokens_per_step == 1024
    assert colocated.prefill.scheduler.prefill_chunk_tokens == 256
    assert colocated.decode.max_running_requests == 6
    default = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate"]))
    assert default.prefill.scheduler.max_prefill_tokens_per_step == 2048
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-step"):
        configs.colocated_stages(
            build_parser().parse_args(["serve", "--colocate", "--max-prefill-tokens-per-step", "0"])
        )


_MEMORY_AND_QUEUE_FLAGS = {
    "prefill": [
        "--kv-store-bytes",
        "987654321",
        "--kv-ttl",
        "33",
        "--max-waiting-prefills",
        "5",
        "--max-waiting-prompt-tokens",
        "40000",
    ],
    "decode": ["--kv-budget-bytes", "123456789", "--max-waiting-requests", "9"],
}


def _assert_memory_and_queue_flags(prefill: PrefillConfig, decode: DecodeConfig) -> None:
    assert (prefill.kv_store_bytes, prefill.kv_ttl_s) == (987654321, 33.0)
    assert (prefill.scheduler.max_waiting_prefills, prefill.scheduler.max_waiting_prompt_tokens) == (5, 40000)
    assert (decode.kv_budget_bytes, decode.max_waiting_requests) == (123456789, 9)


def test_the_kv_memory_and_queue_flags_reach_every_replica_of_their_stage_and_the_colocated_ones():
    """`epd serve --kv-budget-bytes/--max-waiting-requests` (decode's KV memory and queue) and
    `--kv-store-bytes/--kv-ttl/--max-waiting-prefills/--max-waiting-prompt-tokens` (prefill's KV
    store and queue): only `epd serve decode|prefill` took the first five, so a stack's decoders
    had 4 GiB of KV memory whatever was asked; --colocate also dropped --kv-ttl."""
    flags = [*_MEMORY_AND_QUEUE_FLAGS["prefill"], *_MEMORY_AND_QUEUE_FLAGS["decode"]]
    args = build_parser().parse_args(["serve", "--prefills", "2", "--decodes", "3", *flags])
    args.model = "/m"
    commands = stack_commands(args)
    decoders = [configs.decode_config(_parsed(commands[f"decode[{i}]"])) for i in range(3)]
    for i in range(2):
        prefill = configs.prefill_config(_parsed(commands[f"prefill[{i}]"]))
        for decode in decoders:
            _assert_memory_and_queue_flags(prefill, decode)
    for name, command in commands.items():  # each flag to its own stage only
        for role, own in _MEMORY_AND_QUEUE_FLAGS.items():
            assert name.startswith(role) or not set(own[::2]) & set(command), (name, role)

    colocated = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate", *flags]))
    _assert_memory_and_queue_flags(colocated.prefill, colocated.decode)


def test_every_flag_of_a_stage_is_a_flag_of_the_stack_with_the_same_default_and_help():
    """One definition per flag (`STAGE_FLAGS`): `epd serve` takes each flag of `epd serve ROLE` it
    passes on, and both say and default the same."""
    import argparse

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    roles = serve._subparsers._group_actions[0].choices
    for role, adders in STAGE_FLAGS.items():
        own = argparse.ArgumentParser(add_help=False)
        for add_flags in adders:
            add_flags(own)
        for action in own._actions:
            flag = action.option_strings[0]
            for parser in (serve, roles[role]):
                twin = parser._option_string_actions[flag]
                assert (twin.default, twin.help, twin.type) == (action.default, action.help, action.type), (
                    flag
                )
    assert {"--kv-budget-bytes", "--max-waiting-requests"} <= set(stage_flags(_stack([]), "decode"))
    assert {
        "--kv-store-bytes",
        "--kv-ttl",
        "--max-waiting-prefills",
        "--max-waiting-prompt-tokens",
        "--prefix-cache-bytes",
    } <= set(stage_flags(_stack([]), "prefill"))


def _stack(flags: list[str]):
    args = build_parser().parse_args(["serve", *flags])
    args.model = "/m"
    return args


def test_the_stacks_stages_and_the_colocated_ones_keep_the_roles_defaults():
    """Unset, every flag a stage shares with `epd serve` has the role's default: the stack's
    replicas are configured as `epd serve ROLE` started alone, the colocated stages as the configs'
    defaults."""
    args = build_parser().parse_args(["serve"])
    args.model = "/m"
    commands = stack_commands(args)
    makers = {
        "encoder": configs.encoder_config,
        "prefill": configs.prefill_config,
        "decode": configs.decode_config,
    }
    for role, make in makers.items():
        alone = make(build_parser().parse_args(["serve", role, "--model", "/m"]))
        assert make(_parsed(commands[f"{role}[0]"])) == alone, role
    colocated = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate"]))
    model, server = colocated.model, ServerConfig()  # (the colocated stages serve through the front door)
    assert replace(colocated.prefill, server=server) == PrefillConfig(model=model, server=server)
    assert replace(colocated.decode, server=server) == DecodeConfig(model=model, server=server)
    assert colocated.decode.kv_budget_bytes == 4 << 30 and colocated.prefill.kv_store_bytes == 4 << 30


@pytest.mark.parametrize(
    "role,flags,expected",
    [
        ("decode", ["--kv-budget-bytes", "0"], "--kv-budget-bytes must be > 0"),
        ("decode", ["--max-waiting-requests", "-1"], "--max-waiting-requests >= 0"),
        ("prefill", ["--kv-store-bytes", "-1"], "kv_store_bytes (--kv-store-bytes) must be >= 0, got -1"),
        ("prefill", ["--kv-ttl", "0"], "kv_ttl_s (--kv-ttl) must be > 0 seconds"),
        (
            "prefill",
            ["--max-waiting-prefills", "0"],
            "(--max-waiting-prefills) and max_waiting_prompt_tokens",
        ),
        (
            "prefill",
            ["--max-waiting-prompt-tokens", "100"],
            "(--max-waiting-prompt-tokens, 100) must be >= max_prompt",
        ),
        (
            "prefill",
            ["--max-prefill-tokens-per-step", "0"],
            "(--max-prefill-tokens-per-step) must be >= 1, got 0",
        ),
    ],
)
def test_a_stage_flag_its_stage_refuses_stops_the_stack_before_it_starts(capsys, role, flags, expected):
    """The message `epd serve ROLE` gives, from the launcher before any process starts (before,
    every replica imported torch, then one exited 2 and stopped the stack), and from --colocate."""
    makers = {"prefill": configs.prefill_config, "decode": configs.decode_config}
    _assert_refused_alone_by_the_stack_and_colocated(
        capsys, role, makers[role], configs.colocated_stages, flags, expected
    )
    assert stage_flag_problem(build_parser().parse_args(["serve"])) is None


def _assert_refused_alone_by_the_stack_and_colocated(
    capsys, role, make, make_colocated, flags, expected
) -> None:
    """`epd serve ROLE FLAGS` refuses them (`make`), `epd serve FLAGS` too before anything starts
    (one line, exit 2), and --colocate (`make_colocated`), all with `expected` in the message."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        make(build_parser().parse_args(["serve", role, *flags]))
    args = build_parser().parse_args(["serve", *flags])
    assert expected in (stage_flag_problem(args) or "")
    assert serve_stack(args) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("epd serve: ") and expected in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=re.escape(expected)):
        make_colocated(build_parser().parse_args(["serve", "--colocate", *flags]))


_FRONT_DOOR_FLAGS = [
    "--served-model-name",
    "Qwen/Qwen2-VL-2B-Instruct",
    "--allowed-local-media-path",
    "/srv/media",
    "--allowed-media-domains",
    "example.com,media.example.org",
    "--media-fetch-timeout",
    "7",
    "--body-timeout",
    "45",
    "--max-inflight-body-bytes",
    "987654321",
    "--max-requests-per-client",
    "3",
    "--sse-keepalive",
    "4",
    "--reasoning-parser",
    "deepseek_r1",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
]


def _assert_front_door_flags(config: GatewayConfig) -> None:
    assert (config.http.served_model_name, config.http.sse_keepalive_s) == ("Qwen/Qwen2-VL-2B-Instruct", 4.0)
    assert config.http.reasoning_parser == "deepseek_r1"
    assert (config.http.enable_auto_tool_choice, config.http.tool_call_parser) == (True, "hermes")
    assert config.http.media == MediaFetchConfig(
        allowed_local_dir="/srv/media",
        fetch_timeout_s=7.0,
        allowed_domains=("example.com", "media.example.org"),
    )
    assert (config.body_timeout_s, config.max_inflight_body_bytes, config.max_requests_per_client) == (
        45.0,
        987654321,
        3,
    )


def test_the_front_doors_flags_reach_the_stacks_gateway_and_the_colocated_one():
    """`epd serve --served-model-name/--allowed-local-media-path/--allowed-media-domains/
    --media-fetch-timeout/--body-timeout/--sse-keepalive/--reasoning-parser/--enable-auto-tool-choice/
    --tool-call-parser/--max-inflight-body-bytes` (and the routing flags, the
    stack's only): only `epd serve gateway` took them, so a stack or --colocate listed the model
    as "epd" whatever a vLLM client asked for, and could read no media URL."""
    routing = ["--routing", "round-robin", "--load-refresh-interval", "2", "--stage-attempt-timeout", "9"]
    args = _stack(["--encoders", "2", *_FRONT_DOOR_FLAGS, *routing])
    commands = stack_commands(args)
    gateway = configs.gateway_config(_parsed(commands["gateway"]))
    _assert_front_door_flags(gateway)
    assert (gateway.routing, gateway.load_refresh_interval_s, gateway.stage_attempt_timeout_s) == (
        "round-robin",
        2.0,
        9.0,
    )
    for name, command in commands.items():  # the gateway's only
        assert name == "gateway" or not set(_FRONT_DOOR_FLAGS[::2] + routing[::2]) & set(command), name

    colocated = configs.colocated_gateway_config(
        build_parser().parse_args(["serve", "--colocate", *_FRONT_DOOR_FLAGS])
    )
    _assert_front_door_flags(colocated)


def test_a_served_model_name_starting_with_a_dash_reaches_the_gateway_whole():
    args = _stack(["--served-model-name=-my-model"])
    assert (
        configs.gateway_config(_parsed(stack_commands(args)["gateway"])).http.served_model_name == "-my-model"
    )


def test_every_flag_the_gateway_shares_with_the_stack_has_the_same_default_and_help_and_reaches_it():
    """One definition per flag (`GATEWAY_FLAGS`): `epd serve` takes each flag of `epd serve gateway`
    it passes on, both say and default the same, and the stack's gateway gets every one with the
    value the stack was given (unset: the role's default)."""
    import argparse

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    role = serve._subparsers._group_actions[0].choices["gateway"]
    own = argparse.ArgumentParser(add_help=False)
    for add_flags in GATEWAY_FLAGS:
        add_flags(own)
    shared = {action.option_strings[0]: action for action in own._actions}
    assert {
        "--served-model-name",
        "--allowed-local-media-path",
        "--allowed-media-domains",
        "--media-fetch-timeout",
        "--body-timeout",
        "--sse-keepalive",
        "--reasoning-parser",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--max-inflight-body-bytes",
        "--routing",
        "--load-refresh-interval",
    } <= set(shared)
    for flag, action in shared.items():
        for parser in (serve, role):
            twin = parser._option_string_actions[flag]
            assert (twin.default, twin.help, twin.type) == (action.default, action.help, action.type), flag
    args = _stack([])
    gateway = _parsed(stack_commands(args)["gateway"])
    alone = build_parser().parse_args(["serve", "gateway"])
    for action in shared.values():
        assert getattr(gateway, action.dest) == getattr(alone, action.dest) == getattr(args, action.dest), (
            action.dest
        )
    # Every flag goes on the gateway's command line, but one whose unset value is None
    # (--reasoning-parser: off) or a switch left off (--enable-auto-tool-choice), which the
    # role's own default says alike.
    passed = {flag for flag, action in shared.items() if action.default not in (None, False)}
    assert set(flag_words(args, GATEWAY_FLAGS)) >= passed and gateway_flags(args) == flag_words(
        args, GATEWAY_FLAGS
    )


def test_the_frame_sampling_flags_are_the_defaults_of_requests_through_the_front_door():
    """`epd serve --fps 1 --max-frames 8` reached the encoders only, but the gateway fills in every
    sampling field a request leaves unset (with fps 2 and 32 frames, its own defaults) before it
    calls them: no request through the stack's gateway or the colocated front door, HTTP or gRPC,
    was sampled as asked. The gateway now takes the same flags, and `epd serve` passes them."""
    flags = ["--fps", "1", "--max-frames", "8", "--max-pixels", "50176"]
    commands = stack_commands(_stack(flags))
    gateway = configs.gateway_config(_parsed(commands["gateway"]))
    encoder = configs.encoder_config(_parsed(commands["encoder[0]"]))
    colocated_args = build_parser().parse_args(["serve", "--colocate", *flags])
    colocated = configs.colocated_gateway_config(colocated_args)
    colocated_encoder = configs.colocated_stages(colocated_args).encoder
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                    {"type": "text", "text": "q"},
                ],
            }
        ]
    }
    for front_door, stage in ((gateway, encoder), (colocated, colocated_encoder)):
        assert (front_door.sampling.fps, front_door.sampling.max_frames, front_door.sampling.max_pixels) == (
            1.0,
            8,
            50176,
        )
        # HTTP without "media", gRPC with no sampling field set: the front door's defaults, sent on.
        http = parse_chat_request(
            body, front_door.http.served_model_name, front_door.sampling, front_door.generation
        )
        grpc = convert.sampling_from_proto(common_pb2.VideoSampling(), front_door.sampling)
        for asked in (http.sampling, grpc):
            assert (
                convert.sampling_from_proto(convert.sampling_to_proto(asked), stage.sampling)
                == stage.sampling
            )
    unset = build_parser().parse_args(["serve", "gateway"])
    assert configs.gateway_config(unset).sampling == SamplingOptions()  # the defaults unchanged
    assert configs.colocated_gateway_config(build_parser().parse_args(["serve", "--colocate"])).sampling == (
        SamplingOptions()
    )


def test_the_stack_still_listens_on_loopback_only():
    """`epd serve` takes none of the gateway's flags to listen beyond loopback (--host, --http-host,
    --no-api-key): its gateway and the colocated front door bind 127.0.0.1, and keys stay optional
    only there."""
    for flag in ("--host", "--http-host", "--no-api-key"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(
                ["serve", flag, "0.0.0.0"] if flag != "--no-api-key" else ["serve", flag]
            )
    gateway = configs.gateway_config(_parsed(stack_commands(_stack(_FRONT_DOOR_FLAGS))["gateway"]))
    colocated = configs.colocated_gateway_config(build_parser().parse_args(["serve", "--colocate"]))
    for config in (gateway, colocated):
        assert (config.server.host, config.http.host, config.http.no_api_key) == ("127.0.0.1", "", False)


def test_the_colocated_front_door_keeps_the_gateways_defaults():
    config = configs.colocated_gateway_config(build_parser().parse_args(["serve", "--colocate"]))
    assert config.http == HttpApiConfig(port=8000, demo=config.http.demo)
    assert (config.body_timeout_s, config.max_inflight_body_bytes, config.max_requests_per_client) == (
        GatewayConfig.body_timeout_s,
        GatewayConfig.max_inflight_body_bytes,
        GatewayConfig.max_requests_per_client,
    )


@pytest.mark.parametrize(
    "flags,expected",
    [
        (
            ["--max-inflight-body-bytes", "1000"],
            "--max-inflight-body-bytes 1000 is below the largest request body",
        ),
        (["--max-requests-per-client", "0"], "--max-requests-per-client must be >= 1, got 0"),
        (["--allowed-media-domains", "\u200b.example"], "not a valid internationalised domain name"),
    ],
)
def test_a_front_door_flag_the_gateway_refuses_stops_the_stack_before_it_starts(capsys, flags, expected):
    """The message `epd serve gateway` gives, from the launcher before any process starts (before,
    the stack started, then its gateway exited 2 and stopped it), and from --colocate."""
    _assert_refused_alone_by_the_stack_and_colocated(
        capsys, "gateway", configs.gateway_config, configs.colocated_gateway_config, flags, expected
    )


def test_ttft_first_gives_the_stacks_decoders_a_lower_cpu_priority():
    """The stack's `--schedule ttft-first` is decode's `--nice 5` (the colocated server orders its
    own steps instead); fifo, the default, leaves every service at the launcher's priority."""

    def nice_of(argv: list[str]) -> dict[str, int]:
        args = build_parser().parse_args(["serve", *argv])
        args.model = "/m"
        commands = stack_commands(args)
        assert all(
            "--nice" not in command for name, command in commands.items() if not name.startswith("decode")
        )
        return {
            name: configs.decode_config(build_parser().parse_args(command[command.index("serve") :])).nice
            for name, command in commands.items()
            if name.startswith("decode")
        }

    assert nice_of(["--schedule", "ttft-first", "--decodes", "2"]) == {"decode[0]": 5, "decode[1]": 5}
    assert nice_of([]) == {"decode[0]": 0}
    for bad in ("-1", "20"):
        with pytest.raises(ValueError, match="--nice must be 0-19"):
            configs.decode_config(build_parser().parse_args(["serve", "decode", "--nice", bad]))


def test_the_encoder_flags_reach_the_stacks_encoders_and_the_colocated_one():
    """`epd serve --frames-per-group/--max-tower-patches-per-step/--decode-workers/--num-frames ...`:
    every encoder and frame-sampling flag reaches each encoder replica (and --max-upload-bytes the
    gateway too); --colocate builds its encoder with them. Unset, each keeps the encoder's default."""
    flags = [
        "--frames-per-group",
        "4",
        "--max-tower-patches-per-step",
        "2048",
        "--decode-workers",
        "3",
        "--num-frames",
        "6",
        "--max-upload-bytes",
        "1000000",
        "--cache-dir",
        "/tmp/tokens",
        "--no-merge-decoded-groups",
    ]
    args = build_parser().parse_args(["serve", "--encoders", "2", *flags])
    args.model = "/m"
    commands = stack_commands(args)
    for name in ("encoder[0]", "encoder[1]"):
        command = commands[name]
        encoder = configs.encoder_config(build_parser().parse_args(command[command.index("serve") :]))
        assert (encoder.frames_per_group, encoder.max_tower_patches_per_step) == (4, 2048)
        assert encoder.decode.num_workers == 3 and encoder.sampling.num_frames == 6
        assert encoder.limits.max_bytes == 1_000_000 and encoder.cache.disk_dir == "/tmp/tokens"
        assert not encoder.merge_decoded_groups
    gateway = configs.gateway_config(
        build_parser().parse_args(commands["gateway"][commands["gateway"].index("serve") :])
    )
    assert gateway.max_upload_bytes == 1_000_000
    assert "--frames-per-group" not in commands["prefill[0]"] + commands["decode[0]"]

    colocated = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate", *flags]))
    assert (colocated.encoder.frames_per_group, colocated.encoder.max_tower_patches_per_step) == (4, 2048)
    assert colocated.encoder.sampling.num_frames == 6 and colocated.encoder.model == colocated.model
    assert not colocated.encoder.merge_decoded_groups
    assert (
        configs.colocated_gateway_config(
            build_parser().parse_args(["serve", "--colocate", *flags])
        ).max_upload_bytes
        == 1_000_000
    )
    unset = build_parser().parse_args(["serve"])
    unset.model = "/m"
    command = stack_commands(unset)["encoder[0]"]
    default = configs.encoder_config(build_parser().parse_args(command[command.index("serve") :]))
    reference = configs.encoder_config(build_parser().parse_args(["serve", "encoder", "--model", "/m"]))
    assert default == reference


@pytest.mark.parametrize(
    "role,make", [("encoder", configs.encoder_config), ("gateway", configs.gateway_config)]
)
def test_fps_with_num_frames_is_refused_at_start(capsys, role, make):
    """`epd serve --fps 1 --num-frames 4` started, and its --fps was never used: the count serves
    every request that names neither, and a request's own fps replaces both. Refused as the request
    level refuses the pair: by the role, by the stack's launcher before anything starts, by --colocate."""
    expected = "--fps 1 and --num-frames 4: give one"
    flags = ["--fps", "1", "--num-frames", "4"]
    _assert_refused_alone_by_the_stack_and_colocated(
        capsys, role, make, configs.colocated_gateway_config, flags, expected
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        configs.colocated_stages(build_parser().parse_args(["serve", "--colocate", *flags]))
    for alone in (["--fps", "1"], ["--num-frames", "4"]):  # each alone still serves
        make(build_parser().parse_args(["serve", role, *alone]))
        assert stage_flag_problem(build_parser().parse_args(["serve", *alone])) is None


def test_the_stacks_gateway_takes_only_the_keys_the_launcher_was_given(monkeypatch, tmp_path):
    """`epd serve --api-key NEW` with an old $EPD_API_KEY in the shell: NEW replaces it, as the
    flag's help says. The gateway got the keys in its file and the launcher's environment too, so
    it also took the old key from $EPD_API_KEY."""
    import os

    from epd.cli import stack_security

    monkeypatch.setenv("EPD_API_KEY", "old-key-in-the-shell")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = build_parser().parse_args(["serve", "--api-key", "new-key"])
    assert configs.api_keys(args) == ("new-key",)
    files = stack_security.StackFiles()
    try:
        argv = stack_commands(args)["gateway"] + stack_security.stack_security_flags(args, files)["gateway"]
        # The gateway parses its command line in the environment the launcher starts it with.
        monkeypatch.setattr(os, "environ", stack_security.services_environment(os.environ))
        gateway = build_parser().parse_args(argv[argv.index("--log-level") :])
        assert configs.api_keys(gateway) == ("new-key",)
    finally:
        files.remove()


def test_the_secret_check_interval_reaches_every_service_and_a_bad_one_is_refused(
    monkeypatch, tmp_path, capsys
):
    """`--secret-check-interval-s`: how often a service looks at its internal secret file, a
    constant of 5 s before (the rotation test waited on it). Each role's, and `epd serve`'s for
    every service of the stack (with the file it makes), down to the object that follows the file;
    refused by the parser (exit 2, naming the flag) and by the typed config below or at 0."""
    from epd.cli import stack_security
    from epd.stages.server_config import SECRET_CHECK_INTERVAL_S, TransportSecurity
    from epd.transport.internal_secrets import internal_secrets

    makers = {
        "encoder": configs.encoder_config,
        "prefill": configs.prefill_config,
        "decode": configs.decode_config,
        "gateway": configs.gateway_config,
    }

    def followed_every_s(role: str, argv: list[str]) -> float:
        args = build_parser().parse_args(argv)
        args.model = "/m"
        security = makers[role](args).server.security
        assert security.internal_secret_file  # the interval only matters with a file
        return internal_secrets(security).check_interval_s

    monkeypatch.delenv("EPD_INTERNAL_SECRET", raising=False)
    monkeypatch.delenv("EPD_INTERNAL_SECRET_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("s" * 32 + "\n")
    for role in makers:
        given = ["serve", role, "--internal-secret-file", str(secret)]
        assert followed_every_s(role, [*given, "--secret-check-interval-s", "0.25"]) == 0.25
        assert followed_every_s(role, given) == SECRET_CHECK_INTERVAL_S == 5.0
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    for argv, expected in ((["serve", "--secret-check-interval-s", "0.25"], 0.25), (["serve"], 5.0)):
        args = build_parser().parse_args(argv)
        args.model = "/m"
        files = stack_security.StackFiles()
        try:
            flags = stack_security.stack_security_flags(args, files)
            for name, command in stack_commands(args).items():
                role = name.split("[")[0]
                argv = [*command, *flags["gateway" if role == "gateway" else "stage"]]
                assert followed_every_s(role, argv[argv.index("serve") :]) == expected, name
        finally:
            files.remove()
    for argv in (["serve", "decode"], ["serve"]):
        for value, why in (("0", "must be > 0 seconds"), ("-1", "must be >= 0 seconds"),
                           ("inf", "must be a finite number of seconds"), ("5s", "expected seconds")):  # fmt: skip
            with pytest.raises(SystemExit) as exit_info:
                build_parser().parse_args([*argv, "--secret-check-interval-s", value])
            assert exit_info.value.code == 2
            assert f"argument --secret-check-interval-s: {why}, got '{value}'" in capsys.readouterr().err
    for value in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--secret-check-interval-s must be > 0 seconds"):
            TransportSecurity(secret_check_interval_s=value)


@pytest.mark.parametrize(
    ("flag", "value", "field", "expected", "default"),
    [
        ("--max-new-tokens-limit", "16", "max_new_tokens_limit", 16, 4096),
        ("--max-model-len", "8k", "max_model_len", 8000, None),  # vLLM's forms: 8k is 8,000, 8K 8,192
        ("--max-model-len", "8K", "max_model_len", 8192, None),
        ("--max-prompt-tokens", "64K", "max_prompt_tokens", 65536, 32768),
    ],
)
def test_prefills_request_limits_reach_every_prefill_and_the_colocated_one(
    flag, value, field, expected, default
):
    """`--max-new-tokens-limit` (the most tokens a request may ask for, at most decode's bound)
    and vLLM's `--max-model-len` (prompt plus answer; unset: the model's context): the prefill
    role's, and `epd serve`'s for every prefill or the colocated one; unset, not passed at all."""
    args = build_parser().parse_args(["serve", "--prefills", "2", flag, value])
    args.model = "/m"
    commands = stack_commands(args)
    assert [getattr(configs.prefill_config(_parsed(commands[f"prefill[{i}]"])), field) for i in range(2)] == [
        expected
    ] * 2
    assert not any(flag in commands[name] for name in commands if not name.startswith("prefill"))
    assert (
        getattr(
            configs.colocated_stages(build_parser().parse_args(["serve", "--colocate", flag, value])).prefill,
            field,
        )
        == expected
    )
    unset = build_parser().parse_args(["serve", "--colocate"])
    assert getattr(configs.colocated_stages(unset).prefill, field) == default
    assert (flag in stack_commands(unset)["prefill[0]"]) == (default is not None)


def test_a_max_model_len_above_the_checkpoints_context_stops_the_stack_before_anything_starts(
    tiny_models, capsys
):
    """Every prefill replica would refuse it once its model is loaded (exit 3); the launcher reads
    config.json first and says so in the same line, with nothing started."""
    model = tiny_models["qwen2_vl"]
    config = json.loads((model / "config.json").read_text())
    context = config.get("text_config", config)["max_position_embeddings"]
    args = build_parser().parse_args(["serve", "--model", str(model), "--max-model-len", str(context + 1)])
    assert serve_stack(args) == EXIT_MODEL
    assert capsys.readouterr().err == (
        f"epd: cannot load {model}: --max-model-len {context + 1} is more than this model's context of {context} "
        f"tokens (config.json's max_position_embeddings); it may only lower it: pass at most {context}, or leave "
        "it out\n"
    )
    check_max_model_len(str(model), context)  # the model's own context: served
    check_max_model_len("Qwen/Qwen2-VL-2B-Instruct", 10**9)  # a hub id: prefill checks it once loaded


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--max-new-tokens-limit", "4097", "must be 1 to 4096 tokens"),
        ("--max-model-len", "0", "must be at least 1 token, got '0'"),
        ("--max-model-len", "-5", "expected a positive number of tokens"),
        (
            "--max-model-len",
            "1.5K",
            "expected a positive number of tokens",
        ),  # vLLM's: decimals with k, m, g only
        # vLLM's "fit the GPU"
        ("--max-model-len", "-1", "leave --max-model-len out to serve the model's own context"),
        ("--max-model-len", "auto", "leave --max-model-len out to serve the model's own context"),
        ("--max-prompt-tokens", "0", "must be at least 1 token, got '0'"),
        ("--max-prompt-tokens", "-1", "expected a positive number of tokens"),
    ],
)
def test_prefills_request_limits_refuse_values_they_cannot_serve(capsys, flag, value, expected):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "prefill", f"{flag}={value}"])
    assert expected in capsys.readouterr().err


def test_max_model_len_takes_vllms_decimal_suffix_with_a_fraction():
    assert build_parser().parse_args(["serve", "prefill", "--max-model-len", "25.6k"]).max_model_len == 25600


def test_the_scheduling_policy_reaches_every_stage_of_the_stack_and_the_colocated_ones():
    """`epd serve --scheduling-policy priority` (vLLM's flag): every replica of every stage, and
    --colocate's stages, schedule by priority; the default is fcfs everywhere; the gateway has no
    such flag (it learns prefill's policy from GetModelInfo)."""
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority", "--decodes", "2"])
    args.model = "/m"
    commands = stack_commands(args)
    for name, command in commands.items():
        assert ("--scheduling-policy" in command) == (name != "gateway"), name
    role_args = {
        name: build_parser().parse_args(command[command.index("serve") :])
        for name, command in commands.items()
        if name != "gateway"
    }
    assert configs.encoder_config(role_args["encoder[0]"]).scheduling_policy == "priority"
    assert configs.prefill_config(role_args["prefill[0]"]).scheduler.scheduling_policy == "priority"
    for name in ("decode[0]", "decode[1]"):
        assert configs.decode_config(role_args[name]).scheduling_policy == "priority"
    colocated = configs.colocated_stages(
        build_parser().parse_args(["serve", "--colocate", "--scheduling-policy", "priority"])
    )
    assert (colocated.encoder.scheduling_policy, colocated.prefill.scheduler.scheduling_policy,
            colocated.decode.scheduling_policy) == ("priority",) * 3  # fmt: skip
    default = configs.colocated_stages(build_parser().parse_args(["serve", "--colocate"]))
    assert default.decode.scheduling_policy == "fcfs"
