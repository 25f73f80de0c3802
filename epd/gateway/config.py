"""Settings of the front door."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from epd.gateway.dns_replicas import DNS_REFRESH_INTERVAL_S, parse_dns_entry
from epd.gateway.reasoning import REASONING_PARSERS
from epd.gateway.tool_parsers.stream import TOOL_CALL_PARSERS
from epd.model_runtime.generation_defaults import GenerationDefaults
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.server_config import ServerConfig, is_loopback
from epd.video.types import DecodeLimits, SamplingOptions

DEFAULT_PORT = 50050

SCHEDULES = ("fifo", "ttft-first")


MAX_CONCURRENT_STEPS = 3
"""One call per stage at a time: encode, prefill, decode."""


@dataclass(frozen=True)
class SharedModelSchedule:
    """How the three stages' steps share the model threads of `epd serve --colocate`.

    fifo (default): in the order they are asked for (a decode step between any two others).
    ttft-first: the decode core's admissions (each starts a request's decoding; its first token
    already left with prefill's answer unless that token ends it) go ahead of every queued step, and
    encode and prefill steps go before a waiting decode step, which waits at most
    `decode_max_wait_s` (so every running request still gets a token at least that often): the
    prefill-first policy of SGLang's scheduler. Measured on the 2-core bench machine at 16 in flight
    (docs/benchmarks.md, "First tokens first", before the first token left with prefill's answer),
    it moves time from the first token to the tokens after it at the same requests/s; fifo, which
    keeps the time per token lower, is the default (vLLM's V1 scheduler also serves running decodes
    first).

    concurrent_steps: how many of the stages' model calls run at once (the model threads'
    `workers`): 1, one at a time; 2 (default), a decode step beside an encode or prefill step (each
    stage still runs its own steps one after another); 3, all three stages at once. Measured on
    the 2-core bench machine at 16 in flight (docs/benchmarks.md, "Two steps at once"), 2 (with the
    cores split among the calls running, `--num-threads auto`) against 1: TPOT p50 -40% and -13%,
    TTFT p50 -5% and -35%, requests/s +2% and +4% (8 frames / 32 tokens; 4 frames / 64 tokens)."""

    policy: str = "fifo"
    decode_max_wait_s: float = 0.3
    concurrent_steps: int = 2

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.policy!r}")
        if not self.decode_max_wait_s > 0:
            raise ValueError(f"the decode step's longest wait must be > 0 s, got {self.decode_max_wait_s}")
        if not 1 <= self.concurrent_steps <= MAX_CONCURRENT_STEPS:
            raise ValueError(
                f"concurrent steps must be 1 to {MAX_CONCURRENT_STEPS} (one per stage), got {self.concurrent_steps}"
            )

    def deferred_lanes(self) -> dict[str, float]:
        return {"decode": self.decode_max_wait_s} if self.policy == "ttft-first" else {}

    def first_calls_ahead(self) -> bool:
        return self.policy == "ttft-first"


@dataclass(frozen=True)
class MediaFetchConfig:
    """Where the HTTP API may take media from besides `data:` URLs (both off by default)."""

    allowed_local_dir: str = ""
    """Local paths and file:// URLs are read only under this directory (symlinks resolved);
    "" refuses every local path."""
    allowed_domains: tuple[str, ...] = ()
    """http(s) URLs are fetched only from these hosts or their subdomains; () refuses every URL.
    Private, loopback and link-local addresses are refused whatever the name."""
    fetch_timeout_s: float = 30.0
    """Whole-fetch deadline of one http(s) media URL, redirects included."""
    max_redirects: int = 3
    """Redirects followed, each to the same scheme, host and port only."""
    allow_private_addresses: bool = False
    """Let http(s) URLs reach private/loopback addresses (tests and closed networks only)."""


@dataclass(frozen=True)
class WebDemoConfig:
    """The web demo's `POST /demo/frames`, the one place the gateway decodes media itself (to
    show the frames the encoder would sample): untrusted media, so bounded like the encoder's."""

    max_concurrent_decodes: int = 2
    """Demo decodes running at once, on threads of their own; more get HTTP 429 + Retry-After.
    A decode whose client went away counts until it has stopped (at its next frame, or within
    256 packets of its demux pass)."""
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    """Frame size, decoded pixels, duration, demux and decode time of one demo decode: the
    encoder's flags of the same names (`--max-source-pixels`, ...), with the same defaults; its
    byte limit is always the gateway's --max-upload-bytes."""

    def __post_init__(self) -> None:
        if self.max_concurrent_decodes < 1:
            raise ValueError(f"--demo-max-concurrent-decodes must be >= 1, got {self.max_concurrent_decodes}")


@dataclass(frozen=True)
class HttpApiConfig:
    """The OpenAI-compatible HTTP API, served by the gateway process next to gRPC."""

    port: int | None = None
    """TCP port of the HTTP API; None turns it off, 0 binds a free port the kernel picks
    (`--http-port auto`: the port is in `ServerConfig.ports_file` and the log)."""
    host: str = ""
    """Interface to bind; "" means the gRPC server's host."""
    api_keys: tuple[str, ...] = ()
    """When any is set, the HTTP paths vLLM's key guards (`http_checks.KEYED_PATH_PREFIXES`: /v1 and
    the rest), the web demo's POST /demo/frames and the gRPC GatewayService need
    `Authorization: Bearer <key>` with one of them (HTTP /health and /metrics and the gRPC health
    service stay open for probes). Each key is its own cache tenant
    (`epd.transport.auth.request_cache_salt`). Required when the gRPC or HTTP API listens on a
    non-loopback interface, unless `no_api_key`."""
    no_api_key: bool = False
    """Serve a non-loopback interface with no API key (`--no-api-key`): for closed, trusted
    networks only. Without it the gateway refuses to start open beyond loopback."""
    served_model_name: str = "epd"
    """The model id that /v1/models lists and requests must name."""
    sse_keepalive_s: float = 15.0
    """A streamed answer with no token yet gets an SSE comment line every this many seconds (the
    first one sends the 200), so that proxies' idle timeouts (nginx: 60 s) do not cut a long
    encode; 0 = off (headers only with the first token, so every error keeps its own status)."""
    reasoning_parser: str = ""
    """vLLM's `--reasoning-parser` ("qwen3" or "deepseek_r1"; "" = off: the answer's text whole):
    a chat answer's thinking (`<think> ... </think>`) goes in the message's `reasoning` and
    `reasoning_content`, the rest in `content` (`epd.gateway.reasoning`). Chat only, as vLLM's:
    legacy completions, gRPC and the SDK answer the text whole."""
    enable_auto_tool_choice: bool = False
    """vLLM's `--enable-auto-tool-choice`: tool_choice "auto" (the default with tools) is
    answered, the calls found in the answer's text by `tool_call_parser` (`epd.gateway.tool_parsers`);
    off, such a request is a 400 naming both flags, as vLLM's."""
    tool_call_parser: str = ""
    """vLLM's `--tool-call-parser` ("hermes" or "qwen3_coder", by how the model writes its calls;
    "" = none), needed by `enable_auto_tool_choice`."""
    media: MediaFetchConfig = field(default_factory=MediaFetchConfig)
    """Which media URLs and paths requests may use."""
    demo: WebDemoConfig = field(default_factory=WebDemoConfig)
    """The web demo's own decodes (`POST /demo/frames`)."""

    @property
    def parser_on(self) -> bool:
        """Whether a parser reads chat answers, as vLLM's chat serving makes its `parser` object
        (`ParserManager.get_parser`): for `--reasoning-parser`, or for `--enable-auto-tool-choice`
        with `--tool-call-parser` (`--tool-call-parser` alone makes none). Under one,
        `include_reasoning: false` hides every token's logprobs and ids (`ChatRequest.parser_on`)."""
        return bool(self.reasoning_parser) or (self.enable_auto_tool_choice and bool(self.tool_call_parser))

    def __post_init__(self) -> None:
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:  # vLLM refuses to start too
            raise ValueError(
                f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_CALL_PARSERS)}): "
                "the parser says how the model writes its calls"
            )


_ASKING_NOTHING: dict[str, tuple[Any, str]] = {
    "disable_additional_properties": (
        False,
        'the guidance backend\'s; set "additionalProperties": false in the schema',
    ),
    "enable_in_reasoning": (False, "a constraint starts after the reasoning here: vLLM's default, false"),
    "reasoning_parser": ("", "use --reasoning-parser"),
    "reasoning_parser_plugin": ("", "parser plugins are not supported"),
}
"""vLLM's `StructuredOutputsConfig` keys epd does not act on, with the value that asks for nothing
(taken) and what to do instead (any other value: exit 2)."""


def _asks_nothing(value: Any, nothing: Any) -> bool:
    """Whether a key's `value` is its default (`nothing`), a bool read as vLLM's pydantic reads one."""
    from epd.gateway.json_fields import lax_value  # pydantic: when used, not at every `epd --help`

    if isinstance(nothing, bool):
        return lax_value(value, bool) is False
    return value in (nothing, None)


_XGRAMMAR_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's `--structured-outputs-config` (`vllm/config/structured_outputs.py`), the keys epd acts
    on: options of every request's structured output, applied by the front door (`applied`), so
    that prefill and decode compile the same spec."""

    disable_any_whitespace: bool = False
    """JSON constraints (a schema, json_object, a forced tool call's) without free whitespace between
    their tokens: small models otherwise fill an object with newlines and spaces until max_tokens
    (the embedded default model does). A request's own `structured_outputs.disable_any_whitespace`
    cannot turn it off: vLLM's xgrammar backend reads the server's alone."""

    def applied(self, generation: GenerationConfig) -> GenerationConfig:
        """`generation` with this server's options on its structured output, if it has one."""
        spec = generation.structured_outputs
        if spec is None or not self.disable_any_whitespace or spec.disable_any_whitespace:
            return generation
        return replace(generation, structured_outputs=replace(spec, disable_any_whitespace=True))

    @classmethod
    def from_json(cls, text: str) -> StructuredOutputsConfig:
        """The flag's JSON object, read as vLLM's pydantic config reads it (bools laxly: true, "yes",
        1); ValueError naming the keys epd does not take, or saying what is not JSON."""
        from epd.gateway.json_fields import lax_value  # pydantic: when used, not at every `epd --help`

        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"is not JSON ({exc.msg} at character {exc.pos}): give an object such as "
                "'{\"disable_any_whitespace\": true}'"
            ) from None
        if not isinstance(given, dict):
            raise ValueError(
                f"must be a JSON object such as '{{\"disable_any_whitespace\": true}}', got {text!r}"
            )
        unknown = [
            key
            for key in given
            if key not in ("disable_any_whitespace", "backend", "disable_fallback", *_ASKING_NOTHING)
        ]
        if unknown:
            raise ValueError(
                f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: this server "
                "acts on disable_any_whitespace, and takes vLLM's backend, disable_fallback, "
                f"{', '.join(_ASKING_NOTHING)} where they ask for nothing else"
            )
        unsupported = [
            f"{key} ({why})"
            for key, (nothing, why) in _ASKING_NOTHING.items()
            if key in given and not _asks_nothing(given[key], nothing)
        ]
        backend = given.get("backend", "auto")
        if backend not in _XGRAMMAR_BACKENDS:
            unsupported.append(f'backend {backend!r} (this server\'s is xgrammar: "xgrammar" or "auto")')
        if unsupported:
            raise ValueError(f"not supported by this server: {'; '.join(unsupported)}")
        flags = {}
        for key in ("disable_any_whitespace", "disable_fallback"):  # disable_fallback: none to disable
            flags[key] = lax_value(given.get(key, False), bool)
            if flags[key] is None:
                raise ValueError(f"{key} must be true or false, got {json.dumps(given[key])}")
        return cls(disable_any_whitespace=bool(flags["disable_any_whitespace"]))

    def to_json(self) -> str:
        """The flag's value that gives this config (the stack passes it on to its gateway)."""
        return json.dumps({"disable_any_whitespace": self.disable_any_whitespace})


@dataclass(frozen=True)
class GatewayConfig:
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    encoder_addresses: tuple[str, ...] = ("127.0.0.1:50051",)
    """Replicas of the Encode service: a video goes to the one its sha256 picks (rendezvous
    hashing, `epd.transport.affinity`), so it finds its visual tokens cached; likewise prefill."""
    prefill_addresses: tuple[str, ...] = ("127.0.0.1:50052",)
    decode_addresses: tuple[str, ...] = ("127.0.0.1:50053",)
    max_upload_bytes: int = 256 * 1024 * 1024
    """Largest media upload accepted; larger ones get RESOURCE_EXHAUSTED before any decoding.
    The HTTP API's body limit follows from it (`epd.gateway.admission.max_body_bytes`)."""
    max_requests_per_client: int = 8
    """Requests one client (peer IP) may have in flight on the HTTP and gRPC APIs together;
    more get HTTP 429 / RESOURCE_EXHAUSTED."""
    max_requests_per_api_key: int = 0
    """Requests made with one API key may have in flight over all its clients (both APIs
    together); more get HTTP 429 / RESOURCE_EXHAUSTED. 0 = no per-key limit. Applies only when
    API keys are required (--api-key)."""
    max_inflight_body_bytes: int = 0
    """Request-body bytes (HTTP bodies, gRPC uploads) the process holds at once over all
    requests; more get HTTP 429 / RESOURCE_EXHAUSTED. 0 = twice the largest HTTP body."""
    body_timeout_s: float = 300.0
    """Longest a request body (HTTP) or media upload (gRPC) may take to arrive, whole (HTTP 408 /
    DEADLINE_EXCEEDED past it): a client that sends slowly, or stops, holds its bytes of the body
    budget and its request slot only this long."""

    def __post_init__(self) -> None:
        if not self.body_timeout_s > 0:
            raise ValueError(f"--body-timeout must be > 0 seconds, got {self.body_timeout_s}")
        if not self.dns_refresh_interval_s >= 0:
            raise ValueError(
                f"--dns-refresh-interval must be >= 0 seconds, got {self.dns_refresh_interval_s}"
            )
        for flag, addresses in (
            ("--encoder", self.encoder_addresses),
            ("--prefill", self.prefill_addresses),
            ("--decode", self.decode_addresses),
        ):
            for address in addresses:
                try:
                    parse_dns_entry(address)
                except ValueError as exc:
                    raise ValueError(f"{flag}: {exc}") from None

    replicas_file: str = ""
    """A JSON/YAML file {"encoder": [...], "prefill": [...], "decode": [...]} whose lists replace
    the addresses above for the stages it names, re-read when it changes and on SIGHUP
    (`epd.gateway.replica_list`); "" = the addresses above, fixed."""
    replicas_poll_interval_s: float = 1.0
    """How often the replica file's modification time is looked at."""
    dns_refresh_interval_s: float = DNS_REFRESH_INTERVAL_S
    """Seconds between lookups of the `dns:///NAME:PORT` stage addresses, each expanded into one
    replica per address NAME resolves to (`epd.gateway.dns_replicas`, which says why 10 s); 0 = a
    name found is not looked up again (one not found yet still is, every second)."""
    routing: str = "affinity"
    """"affinity": media calls to their rendezvous home unless it is overloaded, other calls to
    the least loaded replica; "round-robin": every call in turn (a baseline for benchmarks)."""
    affinity_max_excess_load: int = 4
    """Requests a media call's home replica may have beyond the least loaded replica before the
    call goes to its next choice (`epd.transport.affinity.MAX_EXCESS_LOAD`)."""
    load_refresh_interval_s: float = 0.5
    """Seconds between reads of the replicas' loads (LoadService.GetLoad) for routing, of the
    stages with more than one replica, while the gateway has stage calls open
    (`epd.gateway.engine_load.watch_loads`); 0 = only the gateway's own calls in flight count."""
    stage_timeout_s: float = 600.0
    """Deadline of each call to a stage, retries on other replicas included."""
    stage_attempt_timeout_s: float = 120.0
    """Longest one try of a stage call may take (decode: until its first token) before the next
    healthy replica is tried; 0 = no limit but `stage_timeout_s`. Encode and prefill are retried
    whole; decode only before its first token."""
    stage_check_interval_s: float = 1.0
    """Seconds between health checks of the stage replicas: a replica that stops serving leaves
    routing, one that serves again rejoins. The gateway's grpc.health is NOT_SERVING only while
    a stage has no replica serving. 0 checks only until they first serve."""
    max_transfer_bytes: int = 1 << 30
    """Largest visual-embedding tensor accepted from an encoder."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """Defaults for sampling fields a request leaves unset."""
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    """Where the defaults of the sampling fields a request leaves unset come from (--generation-config,
    --override-generation-config); resolved per request by `Pipeline.request_defaults`."""
    http: HttpApiConfig = field(default_factory=HttpApiConfig)
    """The OpenAI-compatible HTTP API (off while `http.port` is None)."""
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """Options of every request's structured output (`--structured-outputs-config`), on both APIs."""


def open_without_key(config: GatewayConfig) -> str | None:
    """Why the gateway must not start with this config (None when it may): a non-loopback
    interface with no API key needs the explicit --no-api-key opt-out."""
    http = config.http
    if http.api_keys and http.no_api_key:
        return "both an API key (--api-key or $EPD_API_KEY) and --no-api-key are set; pass one of them"
    if http.api_keys or http.no_api_key:
        return None
    exposed = [] if is_loopback(config.server.host) else [f"gRPC on {config.server.host or '*'} (--host)"]
    http_host = http.host or config.server.host
    if http.port is not None and not is_loopback(http_host):
        exposed.append(f"HTTP on {http_host or '*'} (--http-host/--host)")
    if not exposed:
        return None
    return (
        f"refusing to serve {' and '.join(exposed)} without an API key: set --api-key KEY (or "
        "$EPD_API_KEY), bind 127.0.0.1, or pass --no-api-key on a closed, trusted network"
    )
