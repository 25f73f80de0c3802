"""A stage's own flags through `epd serve` (epd/cli/stack_commands.py): each reaches every replica
of its stage (and no other) as `epd serve ROLE` would parse it, and the colocated stage; one
definition per flag, with the role's default and help; unset, the role's defaults; a value the
stage refuses stops the stack before it starts."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from epd.cli import configs
from epd.cli.flags.stages import STAGE_FLAGS
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import stack_commands, stage_flag_problem, stage_flags
from epd.decode_svc.config import DecodeConfig
from epd.prefill_svc.config import PrefillConfig
from epd.stages.server_config import ServerConfig
from tests.unit.cli.stack_args import _assert_refused_alone_by_the_stack_and_colocated, _parsed, _stack


def test_the_prefix_cache_flags_reach_the_stacks_prefill():
    args = build_parser().parse_args(["serve", "--prefix-cache-bytes", "0", "--prefix-cache-ttl", "5"])
    args.model = "/m"
    command = stack_commands(args)["prefill[0]"]
    role = build_parser().parse_args(command[command.index("serve") :])
    config = configs.prefill_config(role)
    assert (config.prefix_cache_bytes, config.prefix_cache_ttl_s) == (0, 5.0)
    assert "--prefix-cache-bytes" not in stack_commands(args)["encoder[0]"]


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
