"""The front door's flags through `epd serve` (epd/cli/stack_commands.py): each reaches the stack's
gateway (and no other child) and the colocated front door; one definition per flag, with the
role's default and help; frame sampling flags are the defaults of requests through the front door;
the stack still listens on loopback only; a value the gateway refuses stops the stack before it
starts."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.flags.gateway import GATEWAY_FLAGS
from epd.cli.parsers.root import build_parser
from epd.cli.stack_commands import flag_words, gateway_flags, stack_commands
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.config import GatewayConfig, MediaFetchConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.transport import convert
from epd.v1 import common_pb2
from epd.video.types import SamplingOptions
from tests.unit.cli.stack_args import _assert_refused_alone_by_the_stack_and_colocated, _parsed, _stack

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
            body, front_door.http.served_model_name, front_door.sampling, GenerationConfig()
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
