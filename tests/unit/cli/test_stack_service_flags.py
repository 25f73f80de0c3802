"""The flags of `epd serve` that every service (or every model service) of the stack takes reach the
config of each child they are for, as `epd serve ROLE` would parse them (epd/cli/stack_commands.py),
and of the colocated server: grace period, close timeout, log format, linear kernel, structured
compile timeout, the KV TTL and attempt timeout, the scheduling policy, and --schedule's CPU
priority for decoders."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stack_commands
from tests.unit.cli.stack_args import _parsed


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
