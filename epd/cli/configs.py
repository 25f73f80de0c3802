"""CLI flags -> the typed config of each component (the only place they meet)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from epd.cli.flags.arg_types import http_api_port
from epd.decode_svc.config import DecodeConfig
from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.admission import Admission
from epd.gateway.config import (
    GatewayConfig,
    HttpApiConfig,
    MediaFetchConfig,
    SharedModelSchedule,
    StructuredOutputsConfig,
    WebDemoConfig,
    open_without_key,
)
from epd.gateway.media_fetch import dns_host
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.generation_defaults import SAMPLING_KEYS, GenerationDefaults, generation_defaults
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.model_runtime.threads import AUTO
from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.stages.chat_template import load_chat_template
from epd.stages.errors import InvalidRequest
from epd.stages.server_config import (
    SECRET_CHECK_INTERVAL_S,
    ServerConfig,
    TransportSecurity,
    is_loopback,
    parse_secrets,
    read_secrets,
)
from epd.token_pruning import PruningConfig
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.types import DecodeLimits, SamplingOptions


def model_config(args: argparse.Namespace) -> ModelConfig:
    # No --num-threads: one thread per model call (a stack's services, epd ask); --colocate picks auto.
    threads = 1 if args.num_threads is None else args.num_threads
    return ModelConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_threads=threads,
        linear_kernel=getattr(args, "linear_kernel", "torch"),
        structured_compile_timeout_s=getattr(
            args, "structured_compile_timeout_s", ModelConfig.structured_compile_timeout_s
        ),
    )


def sampling_options(args: argparse.Namespace) -> SamplingOptions:
    """The frame sampling flags. ValueError for --fps with --num-frames: a service's --num-frames
    samples exactly that many frames for every request that names neither, so its --fps would never
    be used (a request's own fps replaces both), the pair every door refuses in a request."""
    if args.fps is not None and args.num_frames:
        raise ValueError(
            f"--fps {args.fps:g} and --num-frames {args.num_frames}: give one (--num-frames N: exactly "
            "N frames for requests that name neither; --fps F: F frames per second, at most "
            "--max-frames); with both, --fps would never be used"
        )
    return SamplingOptions(
        fps=args.fps if args.fps is not None else SamplingOptions.fps,
        max_frames=args.max_frames,
        min_frames=min(2, args.max_frames) if args.max_frames > 0 else 2,
        num_frames=args.num_frames or None,
        max_pixels=args.max_pixels or None,
    )


def pruning_config(args: argparse.Namespace) -> PruningConfig:
    """--pruning PRESET plus --pruning-knob NAME=VALUE, parsed exactly as the servers parse them
    (`PruningConfig.from_knobs`); a bad value is the same InvalidRequest a server answers."""
    try:
        return PruningConfig.from_knobs(dict(args.pruning_knob), args.pruning or "off")
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def generation_config(args: argparse.Namespace, defaults: GenerationConfig | None = None) -> GenerationConfig:
    """`epd ask`'s generation flags; the sampling flags left unset (`SAMPLING_KEYS`) take
    `defaults`' values (embedded: as its pipeline resolves them, `Pipeline.request_defaults`;
    else the server's own)."""
    defaults = defaults or GenerationConfig()
    unset = [key for key in SAMPLING_KEYS if getattr(args, key) is None]
    return GenerationConfig(
        **{key: getattr(defaults if key in unset else args, key) for key in SAMPLING_KEYS},
        fit_max_new_tokens="max_new_tokens" in unset,  # as a request without max_tokens: fitted
        seed=args.seed,
        priority=args.priority,
        stop=tuple(args.stop),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        logit_bias=tuple(sorted(dict(args.logit_bias).items())),
        stop_token_ids=tuple(args.stop_token_id),
        include_stop_str_in_output=args.include_stop_str_in_output,
        allowed_token_ids=tuple(args.allowed_token_id),
        bad_words=tuple(args.bad_word),
        structured_outputs=structured_outputs(args),
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )


def structured_outputs(args: argparse.Namespace) -> StructuredOutputs | None:
    """--json-schema FILE, --json-object, --regex, --choice (repeatable) or --grammar FILE."""
    spec = StructuredOutputs(
        json_schema=args.json_schema or "",
        json_object=args.json_object,
        regex=args.regex or "",
        choice=tuple(args.choice or ()),
        grammar=args.grammar or "",
    )
    return None if spec == StructuredOutputs() else spec


def generation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The generation flags as the SDK's keyword options (`EpdClient.ask`)."""
    generation = generation_config(args)
    options = {  # the SDK has no n: Ask streams one answer
        f.name: getattr(generation, f.name)
        for f in fields(generation)
        if f.name not in ("fit_max_new_tokens", "n")
    }
    # Unset: left off the wire, for the gateway's defaults (its --generation-config).
    options.update({key: None for key in SAMPLING_KEYS if getattr(args, key) is None})
    options["logit_bias"] = dict(generation.logit_bias)
    options["allowed_token_ids"] = list(generation.allowed_token_ids) or None  # None: every token
    return options


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        ports_file=args.ports_file,
        grace_s=args.grace_period,
        close_timeout_s=args.close_timeout_s,
        security=transport_security(args),
    )


def transport_security(args: argparse.Namespace) -> TransportSecurity:
    """--tls-* and the internal secrets (read from --internal-secret-file, else $EPD_INTERNAL_SECRET,
    one a line: the first is presented, every one accepted; none with --insecure-no-internal-auth).
    ValueError: a file that cannot be used, one line."""
    secrets: tuple[str, ...] = ()
    if getattr(args, "insecure_no_internal_auth", False):
        if getattr(args, "internal_secret_file", ""):
            raise ValueError(
                "both --internal-secret-file and --insecure-no-internal-auth are set; pass one of them"
            )
    elif getattr(args, "internal_secret_file", ""):
        secrets = read_secrets(args.internal_secret_file)
    elif getattr(args, "internal_secret_env", ""):
        secrets = parse_secrets(args.internal_secret_env, "$EPD_INTERNAL_SECRET")
    return TransportSecurity(
        tls_cert=getattr(args, "tls_cert", ""),
        tls_key=getattr(args, "tls_key", ""),
        tls_client_ca=getattr(args, "tls_client_ca", ""),
        tls_ca=getattr(args, "tls_ca", ""),
        tls_server_name=getattr(args, "tls_server_name", ""),
        internal_secret=secrets[0] if secrets else "",
        previous_internal_secrets=secrets[1:],
        internal_secret_file=getattr(args, "internal_secret_file", "") if secrets else "",
        secret_check_interval_s=getattr(args, "secret_check_interval_s", SECRET_CHECK_INTERVAL_S),
    )


def health_security(args: argparse.Namespace) -> TransportSecurity:
    """`epd health`'s channel: TLS only (health needs no secret), with --tls-cert/--tls-key as the
    client certificate of a server started with --tls-client-ca. ValueError: flags that do not go
    together (without --tls-ca the channel is plaintext, and a certificate would not be sent)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError(
            "--tls-cert and --tls-key go together: pass both (the client certificate and its key)"
        )
    if args.tls_cert and not args.tls_ca:
        raise ValueError(
            "--tls-cert needs --tls-ca, the CA that signed the server's certificate (a client "
            "certificate is presented over TLS only)"
        )
    return TransportSecurity(
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name
    )


def internal_auth_problem(args: argparse.Namespace, security: TransportSecurity) -> str | None:
    """Why a stage (`epd serve encoder|prefill|decode`) must not start with these flags: it would
    serve anyone who reaches its port, bypassing the gateway's API key and limits; on loopback,
    any local user or any process a browser page can make talk to localhost. Secure by default;
    the opt-out is explicit, wherever it binds. `epd serve` (the stack) gives its stages a
    secret of its own."""
    if args.role not in ("encoder", "prefill", "decode"):
        return None
    if security.internal_secret or security.verifies_clients or args.insecure_no_internal_auth:
        return None
    where = "on loopback" if is_loopback(args.host) else f"on {args.host or '*'} (--host)"
    return (
        f"refusing to serve {where} without the internal secret: a stage is not a public endpoint; "
        "give it the secret the gateway presents (--internal-secret-file PATH or $EPD_INTERNAL_SECRET), "
        "or require client certificates (--tls-client-ca, mTLS); --insecure-no-internal-auth for "
        "development on a closed machine or network only"
    )


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    return _encoder_config(args, model_config(args), server_config(args))


def _encoder_config(args: argparse.Namespace, model: ModelConfig, server: ServerConfig) -> EncoderConfig:
    """The encoder's flags (`add_encoder_flags`, `add_sampling_flags`) over a model and a server."""
    limits = decode_limits(args)
    decode = replace(
        ParallelDecodeConfig(),
        index_cache_bytes=args.index_cache_bytes,
        **({"num_workers": args.decode_workers} if args.decode_workers else {}),
    )
    cache = TokenCacheConfig(memory_budget_bytes=args.cache_memory_bytes, disk_dir=args.cache_dir or None)
    return EncoderConfig(
        model=model,
        server=server,
        limits=limits,
        sampling=sampling_options(args),
        decode=decode,
        frames_per_group=args.frames_per_group,
        cache=cache,
        decode_backend=args.decode_backend,
        max_concurrent_decodes=args.max_concurrent_decodes,
        max_queued_decodes=args.max_queued_decodes,
        max_visual_tokens=args.max_visual_tokens,
        max_tower_patches_per_step=args.max_tower_patches_per_step,
        max_tower_jobs_per_request=args.max_tower_jobs_per_request,
        merge_decoded_groups=args.merge_decoded_groups,
        scheduling_policy=args.scheduling_policy,
    )


def decode_limits(args: argparse.Namespace, with_upload_limit: bool = True) -> DecodeLimits:
    """`add_decode_limit_flags` (and --max-upload-bytes): the encoder's limits, and the web demo's
    (whose byte limit the gateway sets from its own --max-upload-bytes, checked in `checked_gateway`)."""
    return replace(
        DecodeLimits(),
        max_source_pixels=args.max_source_pixels,
        max_decoded_pixels=args.max_decoded_pixels,
        max_demux_s=args.max_demux_s,
        max_decode_s=args.max_decode_s,
        max_duration_s=args.max_duration_s,
        **({"max_bytes": args.max_upload_bytes} if with_upload_limit else {}),
    )


def web_demo_config(args: argparse.Namespace) -> WebDemoConfig:
    """The gateway's demo decodes: its flags, or (`epd serve --colocate`) the encoder's limits."""
    return WebDemoConfig(
        max_concurrent_decodes=args.demo_max_concurrent_decodes,
        limits=decode_limits(args, with_upload_limit=False),
    )


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
"""Bind addresses meaning "every interface": no caller can dial them."""


def prefill_config(args: argparse.Namespace) -> PrefillConfig:
    """ValueError: a prefill bound to every interface with nothing to advertise. It advertised
    "0.0.0.0:PORT", which a decoder on another host dials as its own machine: every KV pull failed
    (or, allowed, reached whatever listened on the decoder's host)."""
    if not args.advertise_address and args.host in WILDCARD_HOSTS:
        raise ValueError(
            f"--host {args.host or '(every interface)'} is not an address decoders can dial to pull "
            "KV caches: pass --advertise-address HOST:PORT (this machine's name or IP, or the "
            "container's service name)"
        )
    return _prefill_config(
        args, model_config(args), server_config(args), advertise_address=args.advertise_address
    )


def _prefill_config(
    args: argparse.Namespace, model: ModelConfig, server: ServerConfig, advertise_address: str = ""
) -> PrefillConfig:
    """Prefill's flags (`STAGE_FLAGS["prefill"]`: KV store, prefix cache, scheduler, max_tokens limit,
    max_model_len, prompt limit, chat template) over a model and a server. ValueError: a
    --chat-template that is neither a file nor a template, or does not parse."""
    return PrefillConfig(
        model=model,
        server=server,
        advertise_address=advertise_address,
        kv_store_bytes=args.kv_store_bytes,
        kv_ttl_s=args.kv_ttl,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_logprobs=args.max_logprobs,
        max_model_len=args.max_model_len,
        max_prompt_tokens=args.max_prompt_tokens,
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_ttl_s=args.prefix_cache_ttl,
        chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        scheduler=PrefillSchedulerConfig(
            max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
            prefill_chunk_tokens=args.prefill_chunk_tokens or None,
            max_waiting_prefills=args.max_waiting_prefills,
            max_waiting_prompt_tokens=args.max_waiting_prompt_tokens,
            scheduling_policy=args.scheduling_policy,
        ),
    )


def ask_prefill_config(args: argparse.Namespace, model: ModelConfig) -> PrefillConfig:
    """`epd ask`'s embedded prefill: the defaults, with its --chat-template and the scheduling
    policy of its --priority (`ask_scheduling_policy`). ValueError: a --chat-template that is
    neither a file nor a template, or does not parse."""
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    scheduler = PrefillSchedulerConfig(scheduling_policy=ask_scheduling_policy(args))
    return PrefillConfig(model=model, chat_template=chat_template, scheduler=scheduler)


def ask_scheduling_policy(args: argparse.Namespace) -> str:
    """The embedded stages' policy: `priority` with a non-zero --priority, which every stage takes
    then as a server started with --scheduling-policy priority does (one request per turn: it has
    nothing to go ahead of); fcfs otherwise, the stages' default."""
    return "priority" if args.priority else "fcfs"


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    return _decode_config(
        args, model_config(args), server_config(args), allow_kv_from=tuple(args.allow_kv_from), nice=args.nice
    )


def _decode_config(
    args: argparse.Namespace,
    model: ModelConfig,
    server: ServerConfig,
    allow_kv_from: tuple[str, ...] = DecodeConfig.allow_kv_from,
    nice: int = DecodeConfig.nice,
) -> DecodeConfig:
    """Decode's flags (`STAGE_FLAGS["decode"]`: KV memory, batch, queue) over a model and a server."""
    return DecodeConfig(
        model=model,
        server=server,
        kv_budget_bytes=args.kv_budget_bytes,
        max_running_requests=args.max_running_requests,
        max_waiting_requests=args.max_waiting_requests,
        scheduling_policy=args.scheduling_policy,
        allow_kv_from=allow_kv_from,
        nice=nice,
    )


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """ValueError: a limit the gateway refuses (`checked_gateway`)."""
    return checked_gateway(
        GatewayConfig(
            server=server_config(args),
            encoder_addresses=tuple(args.encoder),
            prefill_addresses=tuple(args.prefill),
            decode_addresses=tuple(args.decode),
            max_upload_bytes=args.max_upload_bytes,
            max_requests_per_client=args.max_requests_per_client,
            max_inflight_body_bytes=args.max_inflight_body_bytes,
            max_requests_per_api_key=args.max_requests_per_api_key,
            body_timeout_s=args.body_timeout,
            stage_check_interval_s=args.stage_check_interval,
            replicas_file=args.replicas_file,
            dns_refresh_interval_s=args.dns_refresh_interval,
            routing=args.routing,
            stage_attempt_timeout_s=args.stage_attempt_timeout,
            load_refresh_interval_s=args.load_refresh_interval,
            http=http_api_config(args),
            sampling=sampling_options(args),
            generation=generation_defaults_flags(args),  # auto: the model's, from prefill (ModelInfo)
            structured_outputs=structured_outputs_config(args),
        )
    )


def generation_defaults_flags(args: argparse.Namespace) -> GenerationDefaults:
    """Where a request's unset sampling fields take their defaults: --generation-config and
    --override-generation-config (vLLM's; auto: the model's, as its prefill reports them).
    ValueError naming the flag: a file or value that cannot be used."""
    return generation_defaults(args.generation_config, args.override_generation_config)


def colocated_gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """`epd serve --colocate`: the stack's front door (its ports, loopback) over local stages.
    ValueError: a limit the gateway refuses (`checked_gateway`)."""
    security = TransportSecurity(
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca
    )
    # The gateway role's flags `epd serve` shares (`GATEWAY_FLAGS`), but routing: the stages are
    # local, one of each. The HTTP API on the server's host (loopback): `epd serve` sets no --http-host.
    return checked_gateway(
        GatewayConfig(
            server=ServerConfig(
                port=args.gateway_port,
                ports_file=args.ports_file,
                grace_s=args.grace_period,
                close_timeout_s=args.close_timeout_s,  # the local stages' close (`EmbeddedPipeline`)
                security=security,
            ),
            http=http_api_config(args),
            max_requests_per_client=args.max_requests_per_client,
            max_inflight_body_bytes=args.max_inflight_body_bytes,
            max_requests_per_api_key=args.max_requests_per_api_key,
            body_timeout_s=args.body_timeout,
            max_upload_bytes=args.max_upload_bytes,
            sampling=sampling_options(args),
            generation=generation_defaults_flags(args),
            structured_outputs=structured_outputs_config(args),
        )
    )  # the defaults of requests, as the encoder's own (`--fps`, ...)


def structured_outputs_config(args: argparse.Namespace) -> StructuredOutputsConfig:
    """--structured-outputs-config (checked by its flag's type: `structured_outputs_config`)."""
    text = args.structured_outputs_config
    return StructuredOutputsConfig() if text is None else StructuredOutputsConfig.from_json(text)


def checked_gateway(config: GatewayConfig) -> GatewayConfig:
    """`config`, once its admission limits pass their own checks and it is not open beyond
    loopback without a key (ValueError, naming the flag). The gateway checks them again inside its
    event loop, where a bad value would end in a traceback or exit 1; here, before it starts, it is
    one line and a usage error (exit 2)."""
    if problem := open_without_key(config):
        raise ValueError(problem)
    if config.max_upload_bytes < 1:  # else every upload would be refused, the service up but useless
        raise ValueError(f"--max-upload-bytes must be >= 1, got {config.max_upload_bytes}")
    Admission.of_gateway(config)
    return config


@dataclass(frozen=True)
class ColocatedStages:
    """`epd serve --colocate`'s stages: one model for all three, their configs, the shared schedule."""

    model: ModelConfig
    encoder: EncoderConfig
    prefill: PrefillConfig
    decode: DecodeConfig
    schedule: SharedModelSchedule


def colocated_stages(args: argparse.Namespace) -> ColocatedStages:
    """ValueError: a flag value a config refuses."""
    model = model_config(args)
    if args.num_threads is None:  # one model call at a time: every call may use every core
        model = replace(model, num_threads=AUTO)
    # no server of its own: it serves through the front door
    encoder = _encoder_config(args, model, ServerConfig())
    # No servers of their own either: the stages serve through the front door, the cache handed over in memory.
    prefill = _prefill_config(args, model, ServerConfig())
    decode = _decode_config(args, model, ServerConfig())
    schedule = SharedModelSchedule(args.schedule, args.decode_max_wait_s, args.concurrent_steps)
    return ColocatedStages(model, encoder, prefill, decode, schedule)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's API keys: every --api-key, else $EPD_API_KEY, plus --api-key-file's lines; each
    without surrounding whitespace, which no `Authorization: Bearer` header can carry (the key
    could never match). ValueError: an empty --api-key (`--api-key "$KEY"` with KEY unset), which
    ended the gateway with a traceback."""
    if any(not key.strip() for key in args.api_key or ()):
        raise ValueError("--api-key is empty: pass the key clients send (or leave the flag out)")
    keys = [key.strip() for key in args.api_key or ([args.api_key_env] if args.api_key_env.strip() else [])]
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return tuple(dict.fromkeys(keys))


def http_api_config(args: argparse.Namespace) -> HttpApiConfig:
    """ValueError: an --allowed-media-domains entry that is not a domain name (`dns_host`)."""
    for domain in args.allowed_media_domains:
        try:
            dns_host(domain)
        except ValueError as exc:
            raise ValueError(f"--allowed-media-domains: {exc}") from None
    media = MediaFetchConfig(
        allowed_local_dir=args.allowed_local_media_path,
        allowed_domains=tuple(args.allowed_media_domains),
        fetch_timeout_s=args.media_fetch_timeout,
    )
    return HttpApiConfig(
        port=http_api_port(args.http_port),
        host=args.http_host,
        api_keys=api_keys(args),
        no_api_key=args.no_api_key,
        served_model_name=args.served_model_name,
        media=media,
        demo=web_demo_config(args),
        sse_keepalive_s=args.sse_keepalive,
        reasoning_parser=args.reasoning_parser or "",
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser or "",
    )
