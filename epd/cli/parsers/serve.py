"""`epd serve`'s command line: the whole stack on loopback (no role), or one service (`epd serve
encoder|prefill|decode|gateway`), each with its component's flags (`epd.cli.flags`), the stack
taking every stage's and the gateway's too (`STAGE_FLAGS`, `GATEWAY_FLAGS`)."""

from __future__ import annotations

import argparse

from epd.cli.flags.arg_types import (
    addresses,
    count,
    env,
    http_port,
    kv_sources,
    port_number,
    positive_seconds,
    seconds,
)
from epd.cli.flags.gateway import (
    GATEWAY_FLAGS,
    add_admission_flags,
    add_generation_config_flags,
    add_http_api_flags,
    add_routing_flags,
    add_structured_outputs_flags,
)
from epd.cli.flags.media import add_decode_limit_flags, add_max_upload_bytes_flag, add_sampling_flags
from epd.cli.flags.model import COMPILING_ROLES, add_model_flags, add_preload_flags
from epd.cli.flags.modes import COLOCATED, STACK, serves_only
from epd.cli.flags.server import (
    add_grace_flag,
    add_ports_file_flag,
    add_server_flags,
    add_stack_security_flags,
)
from epd.cli.flags.stages import SHARED_STAGE_FLAGS, STAGE_FLAGS

# `epd serve --encoders N ...`: replica i of a stage listens on the stage's port + STEP * i, so
# that the default ports' replicas (50051, 50061, ...; 50052, 50062, ...) never meet.
REPLICA_PORT_STEP = 10
MAX_REPLICAS = 64


SERVE_ROLES = ("encoder", "prefill", "decode", "gateway")


def flags_before_role(argv: list[str]) -> list[str]:
    """The flags written between `serve` and its role (`epd serve --grace-period 7 prefill`):
    argparse would parse them as the stack's and then let the role's defaults overwrite them,
    silently, so `parse_command` refuses them instead."""
    if "serve" not in argv:
        return []
    rest = argv[argv.index("serve") + 1 :]
    role_at = next((i for i, token in enumerate(rest) if token in SERVE_ROLES), None)
    if role_at is None:
        return []
    return [token for token in rest[:role_at] if token.startswith("-")]


def add_serve_command(sub) -> None:
    """`epd serve`: the stack, or one of its services (`SERVE_ROLES`)."""
    # No abbreviations: the roles' own flags (`serve gateway --encoder A`) would read as ambiguous
    # abbreviations of the stack's (--encoder-port, --encoders) before the role's parser sees them.
    serve = sub.add_parser("serve", help="run the stack (default) or one service", allow_abbrev=False)
    roles = serve.add_subparsers(dest="role")
    _add_stage_roles(roles)
    _add_gateway_role(roles)
    _add_stack_flags(serve)


def _add_stage_roles(roles) -> None:
    """`epd serve encoder|prefill|decode`: one model service."""
    from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
    from epd.decode_svc.config import TTFT_FIRST_DECODE_NICE, DecodeConfig
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT

    for role, port in (("encoder", ENCODER_PORT), ("prefill", PREFILL_PORT), ("decode", DECODE_PORT)):
        r = roles.add_parser(role, help=f"run the {role} service")
        add_server_flags(r, port)
        add_model_flags(r, compiles=role in COMPILING_ROLES)
        add_preload_flags(r)
        for add_flags in (*STAGE_FLAGS[role], *SHARED_STAGE_FLAGS):
            add_flags(r)
        if role == "prefill":
            r.add_argument(
                "--advertise-address",
                default="",
                help="HOST:PORT decoders pull KV caches from (default: --host:--port; required "
                "with a --host of every interface, 0.0.0.0 or ::, which no decoder can dial)",
            )
        if role == "decode":
            r.add_argument(
                "--allow-kv-from",
                type=kv_sources,
                default=DecodeConfig.allow_kv_from,
                help="comma-separated HOST:PORT of prefill servers to pull KV from: HOST a DNS "
                "name, IPv4 address or network (10.0.0.0/8), or IPv6 one in brackets "
                "([::1], [fd00::/8]); PORT a number or * (any port); no any-host "
                "wildcard (default: 127.0.0.1:*,localhost:*,[::1]:*)",
            )
            r.add_argument(
                "--nice",
                type=int,
                default=DecodeConfig.nice,
                metavar="N",
                help="add N (0-19) to this process's nice value: a lower CPU priority, so that "
                "encode and prefill sharing its cores go first (first tokens sooner, the "
                f"tokens after them later; the stack's --schedule ttft-first gives "
                f"{TTFT_FIRST_DECODE_NICE})",
            )


def _add_gateway_role(roles) -> None:
    """`epd serve gateway`: the front door, routing to stage replicas at the addresses it is given."""
    from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
    from epd.gateway.config import DEFAULT_PORT as GATEWAY_PORT
    from epd.gateway.config import WebDemoConfig
    from epd.gateway.dns_replicas import DNS_REFRESH_INTERVAL_S
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT

    gw = roles.add_parser("gateway", help="run the front door")
    gw.set_defaults(
        allocator=None, mkl_dispatch=None
    )  # no model, no torch: not the `serve` parser's preloads
    add_server_flags(gw, GATEWAY_PORT)
    gw.add_argument(
        "--encoder",
        type=addresses,
        default=(f"127.0.0.1:{ENCODER_PORT}",),
        help="comma-separated encoder replica addresses (a video goes to the one its sha256 "
        "picks, so its cached tokens are found)",
    )
    gw.add_argument("--prefill", type=addresses, default=(f"127.0.0.1:{PREFILL_PORT}",))
    gw.add_argument("--decode", type=addresses, default=(f"127.0.0.1:{DECODE_PORT}",))
    add_max_upload_bytes_flag(gw)
    gw.add_argument(
        "--max-requests-per-api-key",
        type=int,
        default=0,
        help="requests one API key may have in flight over all its clients (0 = no limit; "
        "only with --api-key)",
    )
    gw.add_argument(
        "--stage-check-interval",
        type=seconds,
        default=1.0,
        help="seconds between stage replica health checks: a replica not serving leaves routing "
        "until it serves again; gateway health is NOT_SERVING while a stage has no replica "
        "serving (0 = check only at start-up)",
    )
    gw.add_argument(
        "--replicas-file",
        default="",
        metavar="PATH",
        help='JSON/YAML {"encoder": [...], "prefill": [...], "decode": [...]} replacing the '
        "address flags for the stages it names; re-read when it changes and on SIGHUP",
    )
    gw.add_argument(
        "--dns-refresh-interval",
        type=seconds,
        default=DNS_REFRESH_INTERVAL_S,
        metavar="SECONDS",
        help="seconds between lookups of dns:///NAME:PORT stage addresses, each routed as one replica "
        "per address NAME resolves to (0 = a name found is not looked up again)",
    )
    add_admission_flags(gw)
    add_routing_flags(gw)
    add_http_api_flags(gw)  # with its listen flags: GATEWAY_FLAGS' without them
    add_generation_config_flags(gw)  # auto: the model's, as prefill reports them (ModelInfo)
    add_structured_outputs_flags(gw)
    demo = gw.add_argument_group("web demo (POST /demo/frames decodes the frames it shows in the gateway)")
    demo.add_argument(
        "--demo-max-concurrent-decodes",
        type=int,
        default=WebDemoConfig.max_concurrent_decodes,
        help="demo decodes at once, on their own threads; more get 429 (one whose client left "
        "counts until it has stopped)",
    )
    add_decode_limit_flags(demo)  # the encoder's limits, which `epd serve` passes to both
    # Requests that leave them unset are sent with these: the encoders' own never apply through the
    # gateway (`epd serve` passes its --fps/--max-frames/... to both).
    add_sampling_flags(gw)


def _add_stack_flags(serve) -> None:
    """`epd serve` with no role: the whole stack on loopback, or --colocate."""
    from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
    from epd.decode_svc.config import TTFT_FIRST_DECODE_NICE
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
    from epd.gateway.config import DEFAULT_PORT as GATEWAY_PORT
    from epd.gateway.config import MAX_CONCURRENT_STEPS, SCHEDULES, SharedModelSchedule, WebDemoConfig
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT

    serve.set_defaults(internal_secret_env=env("EPD_INTERNAL_SECRET", ""))  # else the stack makes one
    # The HTTP API on the gRPC port's interface (loopback) and keys required only where the gateway
    # would refuse to listen without: `epd serve` has no flags to listen beyond loopback.
    serve.set_defaults(http_host="", no_api_key=False)
    serve.add_argument(
        "--gateway-port", type=port_number, default=GATEWAY_PORT, help="0: a free port the kernel picks"
    )
    stage_ports = (
        *(
            serve.add_argument(
                f"--{role}-port",
                type=port_number,
                default=port,
                help=f"replica i of the {role}s on this + {REPLICA_PORT_STEP} * i (0: each a free port the "
                "kernel picks)",
            )
            for role, port in (("encoder", ENCODER_PORT), ("prefill", PREFILL_PORT), ("decode", DECODE_PORT))
        ),
    )
    serves_only(
        STACK,
        "the stack's stage servers' ports; the colocated stages serve none (--gateway-port and --http-port do)",
        *stage_ports,
    )
    serve.add_argument(
        "--http-port",
        type=http_port,
        default=8000,
        help="OpenAI-compatible HTTP API and web demo on the gateway (0 = off; auto = a free port the "
        "kernel picks, see --ports-file)",
    )
    serve.add_argument(
        "--demo-max-concurrent-decodes",
        type=int,
        default=WebDemoConfig.max_concurrent_decodes,
        help="web demo decodes at once in the gateway, on their own threads; more get 429",
    )
    g = serve.add_argument_group("replicas and supervision (the stack on loopback)")
    replicas = count("a number of replicas", MAX_REPLICAS, "replicas")
    supervision = [
        g.add_argument(
            f"--{role}s",
            type=replicas,
            default=1,
            metavar="N",
            help=f"{role} replicas: replica i listens on --{role}-port + {REPLICA_PORT_STEP} * i",
        )
        for role in ("encoder", "prefill", "decode")
    ]
    supervision.append(
        g.add_argument(
            "--health-timeout",
            type=positive_seconds,
            default=10.0,
            metavar="SECONDS",
            help="a service that stops answering its gRPC health check this long is killed and "
            "restarted (a service that exits is restarted too, with backoff; one that "
            "crash-loops is given up on)",
        )
    )
    supervision.append(
        g.add_argument(
            "--start-timeout",
            type=positive_seconds,
            default=600.0,
            metavar="SECONDS",
            help="every service must serve within this long of its start (loading its model), at the "
            "stack's start-up (else the stack exits, code 1) and after a restart (else it is killed "
            "and restarted); raise it for a model slow to load",
        )
    )
    supervision.append(
        g.add_argument(
            "--share-weights",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="the stack's model services (every replica, restarts too) share one copy of the "
            "weights, loaded once by the process they are forked from, copy on write (default; "
            "--no-share-weights: each loads its own). On the CPU with --linear-kernel torch only; "
            "docs/architecture.md, 'Shared weights'",
        )
    )
    why = "the stack's replicas and their supervision; --colocate runs one process with one stage of each"
    serves_only(STACK, why, *supervision)
    serve.add_argument(
        "--colocate",
        action="store_true",
        help="one process instead of four: the front door and the three stages share one "
        "model and the machine's cores (the same front door: --gateway-port and --http-port, "
        "same APIs); for a single machine",
    )
    shared = SharedModelSchedule()
    serve.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=shared.policy,
        help="how the stages' steps share the cores: fifo (in turn) or ttft-first (first "
        "tokens sooner, the tokens after them later). --colocate: decode admissions "
        "ahead of every step, encode and prefill before a waiting decode step, up to "
        "--decode-max-wait-s; the stack: its decoders run at a lower CPU priority "
        f"(decode's --nice {TTFT_FIRST_DECODE_NICE})",
    )
    colocated_schedule = serve.add_argument(
        "--decode-max-wait-s",
        type=positive_seconds,
        default=shared.decode_max_wait_s,
        metavar="SECONDS",
        help="--colocate with --schedule ttft-first: longest a decode step "
        "waits while encode and prefill steps go first",
    )
    steps = count("a number of model calls", MAX_CONCURRENT_STEPS, "(one per stage)")
    concurrent_steps = serve.add_argument(
        "--concurrent-steps",
        type=steps,
        default=shared.concurrent_steps,
        metavar="N",
        help=f"--colocate: model calls of different stages that run at once (1: one at a time; "
        f"2: a decode step beside an encode or prefill step; at most {MAX_CONCURRENT_STEPS}, "
        "one per stage)",
    )
    why = "the colocated stages' sharing of one model's steps; the stack's services each run their own"
    serves_only(COLOCATED, why, colocated_schedule, concurrent_steps)
    add_stack_security_flags(serve)
    add_grace_flag(serve)  # passed to every service; the gateway drains first, then the stages
    add_ports_file_flag(serve)
    # GATEWAY_FLAGS: passed to the stack's gateway, or the colocated front door (not routing: its
    # stages are local, one of each). No --host/--http-host/--no-api-key: `epd serve` listens on
    # loopback only.
    for add_flags in GATEWAY_FLAGS:
        add_flags(serve)
    # STAGE_FLAGS: passed to every replica of their stage, or the colocated stages.
    g = serve.add_argument_group(
        "prefill: KV store, prefix cache, batching, queue, max_tokens limit and chat template "
        "(passed to every prefill, or the colocated one)"
    )
    for add_flags in STAGE_FLAGS["prefill"]:
        add_flags(g)
    g = serve.add_argument_group(
        "decode: KV memory, batch and queue (passed to every decoder, or the colocated one)"
    )
    for add_flags in STAGE_FLAGS["decode"]:
        add_flags(g)
    for add_flags in STAGE_FLAGS["encoder"]:  # their own groups; --max-upload-bytes reaches the gateway too
        add_flags(serve)
    g = serve.add_argument_group("every stage (passed to every replica of each, or the colocated stages)")
    for add_flags in SHARED_STAGE_FLAGS:
        add_flags(g)
    add_model_flags(serve)
    add_preload_flags(serve)  # the launcher's choice; the stack's services inherit it (LD_PRELOAD)
