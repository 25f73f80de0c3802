"""The command lines of the stack's services (`epd serve` with no role), built from the stack's
flags: each replica's port and name, each role's flags as words; and the checks of those flags the
launcher makes before it starts anything (ports, the stages' and the gateway's configs, the
model's context)."""

from __future__ import annotations

import argparse
import sys

MODEL_ROLES = ("encoder", "prefill", "decode")
COMMAND_PREFIX_WORDS = 3  # python -m epd.cli.main
_GATEWAY_STAGE_CHECK_S = 1.0


def replica_ports(args: argparse.Namespace) -> dict[str, list[int]]:
    """Each stage's replicas' ports: replica i on the stage's port + REPLICA_PORT_STEP * i (so with
    one replica, the stage's port); with port 0, 0 for every replica (each binds a free port of
    its own, which the launcher reads from its ports file)."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP

    return {
        role: [
            (port and port + REPLICA_PORT_STEP * i)
            for i in range(getattr(args, f"{role}s"))
            for port in [getattr(args, f"{role}_port")]
        ]
        for role in MODEL_ROLES
    }


def replica_name(role: str, index: int) -> str:
    return f"{role}[{index}]"


def port_clash(args: argparse.Namespace) -> str | None:
    """Why the stack's ports cannot all be bound as asked (two services on one port, one beyond
    65535), or None."""
    from epd.cli.parsers.serve import REPLICA_PORT_STEP

    taken: dict[int, str] = {args.gateway_port: "gateway"} if args.gateway_port else {}
    if isinstance(args.http_port, int) and args.http_port:  # not 0 (off) nor auto (a free port)
        if args.http_port in taken:
            return f"--http-port {args.http_port} is also --gateway-port"
        taken[args.http_port] = "the gateway's HTTP API"
    for role, ports in replica_ports(args).items():
        for i, port in enumerate(ports):
            name = replica_name(role, i)
            if port == 0:  # a free port of its own
                continue
            if port > 65535:
                return f"{name} would listen on port {port} (--{role}-port + {REPLICA_PORT_STEP} * {i}), beyond 65535"
            if port in taken:
                return (
                    f"{name} would listen on port {port}, which {taken[port]} uses (replica i listens on "
                    f"--{role}-port + {REPLICA_PORT_STEP} * i): choose other ports or fewer replicas"
                )
            taken[port] = name
    return None


def stage_flag_problem(args: argparse.Namespace) -> str | None:
    """Why the stack's stages or its gateway would refuse their flags (`--kv-budget-bytes 0`, a
    chunk above the step budget, `--max-requests-per-client 0`, ...), in the words `epd serve ROLE`
    uses, or None. Checked by the launcher before anything starts: else every replica imported
    torch, then one exited 2 and stopped the stack."""
    from epd.cli import configs

    try:
        configs.colocated_stages(args)  # every stage's config from the flags its replicas get, no torch
        configs.colocated_gateway_config(args)  # and the front door's (`GATEWAY_FLAGS`: a bad media domain)
    except ValueError as exc:
        return str(exc)
    return None


def check_max_model_len(model: str, max_model_len: int | None) -> None:
    """ModelLoadError, as every prefill replica would raise once its model is loaded, when
    `--max-model-len` is above the local checkpoint's context (config.json): the stack says so in
    one line before any service starts, not after a replica has loaded the weights."""
    from epd.model_runtime.loader import ModelLoadError, configured_context_tokens
    from epd.prefill_svc.config import PrefillConfig

    if max_model_len is None:
        return
    try:
        PrefillConfig(max_model_len=max_model_len).served_context(configured_context_tokens(model))
    except ValueError as exc:
        raise ModelLoadError(model, str(exc)) from None


def stack_commands(
    args: argparse.Namespace, ports: dict[str, list[int]] | None = None
) -> dict[str, list[str]]:
    """The command line of each service of the loopback stack, by name ("gateway", "encoder[0]",
    "encoder[1]", ...; the model services' are run forked, without their first `COMMAND_PREFIX_WORDS`
    words). `ports`: the replicas' ports the gateway is given, default `replica_ports(args)`; the
    launcher passes those its port-0 replicas bound."""
    from epd.cli.flags.media import add_sampling_flags
    from epd.cli.flags.model import COMPILING_ROLES
    from epd.decode_svc.config import TTFT_FIRST_DECODE_NICE

    log_format = [] if args.log_format == "text" else ["--log-format", args.log_format]  # text: the default
    base = [sys.executable, "-m", "epd.cli.main", "--log-level", args.log_level, *log_format, "serve"]
    threads = [] if args.num_threads is None else ["--num-threads", str(args.num_threads or "auto")]
    model = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        *threads,
        "--linear-kernel",
        args.linear_kernel,
    ]
    grace = ["--grace-period", str(args.grace_period), "--close-timeout-s", str(args.close_timeout_s)]
    own = {role: stage_flags(args, role) for role in MODEL_ROLES}
    for role in COMPILING_ROLES:  # the encoder compiles no structured output
        own[role] += ["--structured-compile-timeout-s", str(args.structured_compile_timeout_s)]
    if args.schedule == "ttft-first":
        own["decode"] += ["--nice", str(TTFT_FIRST_DECODE_NICE)]
    ports = ports or replica_ports(args)
    commands = {
        replica_name(role, i): [*base, role, "--port", str(port), *grace, *model, *own[role]]
        for role in MODEL_ROLES
        for i, port in enumerate(ports[role])
    }
    # Every replica's address: the gateway routes among the healthy ones (by media affinity). Decode
    # needs no list of prefills: its default --allow-kv-from admits every loopback port.
    stages = [
        flag
        for role in MODEL_ROLES
        for flag in (f"--{role}", ",".join(f"127.0.0.1:{port}" for port in ports[role]))
    ]
    # Stage checks every second (cheap on loopback): a restarted replica is back in routing within
    # a second of serving again.
    commands["gateway"] = [
        *base,
        "gateway",
        "--port",
        str(args.gateway_port),
        *grace,
        *stages,
        "--stage-check-interval",
        str(_GATEWAY_STAGE_CHECK_S),
        *gateway_flags(args),
        "--http-port",
        str(args.http_port),
        "--max-upload-bytes",
        str(args.max_upload_bytes),
        "--demo-max-concurrent-decodes",
        str(args.demo_max_concurrent_decodes),
        *decode_limit_flags(args),  # the web demo decodes under the encoders' limits
        # The requests' frame sampling defaults: the gateway fills in every field a
        # request leaves unset, so the encoders' own defaults never apply to them.
        *flag_words(args, (add_sampling_flags,)),
    ]
    return commands


def decode_limit_flags(args: argparse.Namespace) -> list[str]:
    """The stack's `add_decode_limit_flags` values as command-line words."""
    return [
        "--max-source-pixels",
        str(args.max_source_pixels),
        "--max-decoded-pixels",
        str(args.max_decoded_pixels),
        "--max-duration-s",
        repr(args.max_duration_s),
        "--max-demux-s",
        repr(args.max_demux_s),
        "--max-decode-s",
        repr(args.max_decode_s),
    ]


def stage_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The stack's flags of a stage role as that role's command line: every flag its `STAGE_FLAGS`
    functions define (the encoder's and frame sampling; prefill's KV store, prefix cache,
    scheduler and max_tokens limit; decode's KV memory, batch and queue) and every stage's
    (`SHARED_STAGE_FLAGS`: --scheduling-policy), with the value the stack was given."""
    from epd.cli.flags.stages import SHARED_STAGE_FLAGS, STAGE_FLAGS

    return flag_words(args, (*STAGE_FLAGS[role], *SHARED_STAGE_FLAGS))


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The stack's `GATEWAY_FLAGS` (admission, routing, the HTTP API's model name, media and body
    flags) as the gateway's command line, with the value the stack was given."""
    from epd.cli.flags.gateway import GATEWAY_FLAGS

    return flag_words(args, GATEWAY_FLAGS)


def flag_words(args: argparse.Namespace, adders) -> list[str]:
    """Every flag the `adders` define, with its value in `args`, as command-line words."""
    own = argparse.ArgumentParser(add_help=False)
    for add_flags in adders:
        add_flags(own)
    words = []
    for action in own._actions:
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if value is None:  # unset (--fps): the service's own default is the same
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --flag / --no-flag
            words.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true and the like: the flag alone, when set
            words += [flag] if value != action.default else []
        else:
            # tuple: --allowed-media-domains
            text = ",".join(value) if isinstance(value, tuple) else str(value)
            # One word when the value starts with "-" (a --served-model-name): else read as a flag.
            words += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return words
