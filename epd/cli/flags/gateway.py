"""The gateway's flags: admission per client (`Admission`), routing among stage replicas
(`GatewayConfig`), and the OpenAI-compatible HTTP API (`HttpApiConfig`, `MediaFetchConfig`); and
`GATEWAY_FLAGS`, those `epd serve` takes too."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

from epd.cli.flags.arg_types import addresses, env, http_port, positive_seconds, seconds
from epd.cli.flags.modes import STACK, serves_only
from epd.gateway.reasoning import REASONING_PARSERS
from epd.gateway.tool_parsers.stream import TOOL_CALL_PARSERS


def add_admission_flags(p: argparse.ArgumentParser) -> None:
    """The front door's limits per client and on request bodies held (the gateway role, and `epd
    serve` for its gateway or the colocated one)."""
    g = p.add_argument_group("admission")
    g.add_argument(
        "--max-requests-per-client",
        type=int,
        default=8,
        help="requests one client (peer IP) may have in flight on HTTP and gRPC together",
    )
    g.add_argument(
        "--max-inflight-body-bytes",
        type=int,
        default=0,
        help="request-body bytes held at once over all requests (0 = twice the largest HTTP body)",
    )


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """How the gateway spreads stage calls over replicas (the gateway role, and `epd serve` for its
    stack's gateway; --colocate has one local stage of each, nothing to route)."""
    g = p.add_argument_group("routing among stage replicas")
    routing = g.add_argument(
        "--routing",
        choices=("affinity", "round-robin"),
        default="affinity",
        help="affinity: a video's calls go to the replicas holding its caches (unless "
        "overloaded), others to the least loaded; round-robin: every call in turn",
    )
    attempt_timeout = g.add_argument(
        "--stage-attempt-timeout",
        type=seconds,
        default=120.0,
        metavar="SECONDS",
        help="longest one try of a stage call may take (decode: until its first token) before "
        "the next replica is tried (0 = only the stage deadline)",
    )
    load_refresh = g.add_argument(
        "--load-refresh-interval",
        type=seconds,
        default=0.5,
        metavar="SECONDS",
        help="seconds between reads of the replicas' loads for routing, of the stages with more than one "
        "replica, while requests are in flight (0 = off)",
    )
    why = "routing among a stack's stage replicas; the colocated front door has one local stage of each"
    serves_only(STACK, why, routing, attempt_timeout, load_refresh)


def add_http_listen_flags(p: argparse.ArgumentParser, g) -> None:
    """Where the gateway's HTTP API listens and who may call it: `epd serve gateway` only (`epd
    serve` listens on loopback alone, with its own --http-port and the keys of
    `add_stack_security_flags`)."""
    g.add_argument(
        "--http-port",
        type=http_port,
        default=0,
        help="port of the HTTP API (0 = off; auto = a free port the kernel picks, see --ports-file)",
    )
    g.add_argument("--http-host", default="", help="interface of the HTTP API (default: --host)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (and vLLM's other guarded paths) and the gRPC API "
        "(default: $EPD_API_KEY); "
        "repeat it (or use --api-key-file) for several keys, each its own cache tenant; "
        "needed to listen beyond loopback unless --no-api-key",
    )
    g.add_argument(
        "--api-key-file",
        default="",
        metavar="PATH",
        help="more API keys, one per line ('#' starts a comment)",
    )
    p.set_defaults(api_key_env=env("EPD_API_KEY", ""))
    g.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve a non-loopback --host/--http-host with no API key: closed, trusted networks only",
    )


def add_http_api_flags(p: argparse.ArgumentParser, listen: bool = True) -> None:
    """The HTTP API's flags: with `listen`, where it listens (`add_http_listen_flags`, the gateway
    role); the rest (model name, media, body) `epd serve` takes too (`GATEWAY_FLAGS`)."""
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    if listen:
        add_http_listen_flags(p, g)
    g.add_argument("--served-model-name", default="epd", help="model id listed by /v1/models")
    g.add_argument(
        "--allowed-local-media-path",
        default="",
        help="directory that local paths / file:// media URLs may be read from (default: none)",
    )
    g.add_argument(
        "--allowed-media-domains",
        type=addresses,
        default=(),
        help="comma-separated domains http(s) media URLs may be fetched from (default: none); "
        "private addresses are refused regardless",
    )
    g.add_argument(
        "--media-fetch-timeout", type=positive_seconds, default=30.0, help="seconds to fetch one media URL"
    )
    g.add_argument(
        "--body-timeout",
        type=positive_seconds,
        default=300.0,
        metavar="SECONDS",
        help="seconds a request body may take to arrive, whole (HTTP 408 past it)",
    )
    g.add_argument(
        "--sse-keepalive",
        type=seconds,
        default=15.0,
        metavar="SECONDS",
        help="a streamed answer with no token yet gets an SSE comment this often, so that "
        "proxies' idle timeouts do not cut a long encode (0 = off: the 200 comes with the "
        "first token, and every error before it keeps its own HTTP status)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="vLLM's: a thinking model's chat answer parted at <think> ... </think> into the "
        "message's reasoning (and reasoning_content) and content (default: off, the text whole)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's: answer tool_choice \"auto\" (the default with tools): the chat answer's tool calls, "
        "found by --tool-call-parser, go in the message's tool_calls (default: off, such a request is a 400)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="vLLM's: how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, the Qwen2.5, "
        "Qwen3 and Qwen3-VL templates' form; qwen3_coder: <tool_call><function=NAME><parameter=P>..., "
        "Qwen3-Coder's and Qwen3.5's); needed by --enable-auto-tool-choice",
    )


def add_generation_config_flags(p: argparse.ArgumentParser) -> tuple[argparse.Action, ...]:
    """vLLM's defaults of a request's unset sampling fields (`epd.model_runtime.generation_defaults`):
    the front door's, as it resolves every door's requests (the gateway role, `epd serve`), and
    embedded `epd ask`'s."""
    from epd.model_runtime.generation_defaults import (
        GENERATION_CONFIG_HELP,
        OVERRIDE_GENERATION_CONFIG_HELP,
    )

    g = p.add_argument_group("request defaults")
    return (
        g.add_argument(
            "--generation-config", default="auto", metavar="{auto,vllm,DIR}", help=GENERATION_CONFIG_HELP
        ),
        g.add_argument(
            "--override-generation-config", default="", metavar="JSON", help=OVERRIDE_GENERATION_CONFIG_HELP
        ),
    )


STRUCTURED_OUTPUTS_CONFIG = "--structured-outputs-config"


def structured_outputs_config(text: str) -> str:
    """--structured-outputs-config: a JSON object of vLLM's keys (`StructuredOutputsConfig.from_json`),
    kept as the JSON of the keys epd acts on, which the stack passes on to its gateway."""
    from epd.gateway.config import StructuredOutputsConfig

    try:
        return StructuredOutputsConfig.from_json(text).to_json()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_structured_outputs_flags(p: argparse.ArgumentParser) -> argparse.Action:
    """vLLM's server-wide structured-output options (the gateway role, and `epd serve` for its
    gateway or the colocated front door; embedded `epd ask`'s, as its own front door): the front
    door applies them to every request's spec."""
    g = p.add_argument_group("structured outputs")
    return g.add_argument(
        STRUCTURED_OUTPUTS_CONFIG,
        type=structured_outputs_config,
        default=None,
        metavar="JSON",
        help="vLLM's: '{\"disable_any_whitespace\": true}' (or --structured-outputs-config.disable_any_whitespace "
        "true) holds every JSON constraint to no free whitespace (small models otherwise pad JSON with it "
        "until max_tokens); vLLM's backend (xgrammar or auto) and disable_fallback are taken and change "
        "nothing, its other keys are refused unless they ask for nothing",
    )


GATEWAY_FLAGS: tuple[Callable[..., object], ...] = (
    add_admission_flags,
    add_routing_flags,
    functools.partial(add_http_api_flags, listen=False),
    add_generation_config_flags,
    add_structured_outputs_flags,
)
"""The gateway role's flags `epd serve` takes too: one definition each, passed to the stack's
gateway (`epd/cli/stack_commands.py` `gateway_flags`) or built into the colocated front door's config
(`epd/cli/configs.py` `colocated_gateway_config`; routing excepted, its stages being local)."""
