"""The children's command lines of `epd serve` (epd/cli/stack_commands.py): every flag the stack
takes reaches the config of each replica it is for (and no other), as `epd serve ROLE` would parse it,
and of the colocated stages; replica ports; flags a stage would refuse stop the stack before it starts."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from epd.cli import configs
from epd.cli.flags.gateway import GATEWAY_FLAGS
from epd.cli.flags.stages import STAGE_FLAGS
from epd.cli.launcher import serve_stack
from epd.cli.parsers.root import build_parser
from epd.cli.process_exit import EXIT_USAGE
from epd.cli.stack_commands import (
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
from epd.gateway.config import GatewayConfig, MediaFetchConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.server_config import ServerConfig
from epd.transport import convert
from epd.v1 import common_pb2
from epd.video.types import SamplingOptions


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
    # But --generation-config auto, the model's folder: the gateway holds none, so it is named
    # (/m has no generation_config.json: vllm, no defaults either way).
    assert (gateway.generation_config, args.generation_config) == ("vllm", "auto")
    for action in shared.values():
        if action.dest != "generation_config":
            assert (
                getattr(gateway, action.dest) == getattr(alone, action.dest) == getattr(args, action.dest)
            ), action.dest
    # Every flag goes on the gateway's command line, but one whose unset value is None
    # (--reasoning-parser: off) or a switch left off (--enable-auto-tool-choice), which the
    # role's own default says alike.
    passed = {flag for flag, action in shared.items() if action.default not in (None, False)}
    named = argparse.Namespace(**{**vars(args), "generation_config": "vllm"})
    assert set(flag_words(args, GATEWAY_FLAGS)) >= passed and gateway_flags(args) == flag_words(
        named, GATEWAY_FLAGS
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
