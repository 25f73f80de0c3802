"""Settings of the Prefill service."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.logprobs import MAX_LOGPROBS
from epd.model_runtime.sampling import MAX_NEW_TOKENS
from epd.stages.scheduling import check_scheduling_policy
from epd.stages.server_config import ServerConfig

DEFAULT_PORT = 50052


@dataclass(frozen=True)
class PrefillSchedulerConfig:
    """The prefill core's scheduler (`prefill_svc/scheduler.py`)."""

    max_prefill_tokens_per_step: int = 2048
    """Prompt tokens one step computes at most, over every prompt in it (--max-prefill-tokens-per-step)."""
    prefill_chunk_tokens: int | None = 512
    """Prompts longer than this run in chunks of at most this many tokens, one chunk per step, so a
    long video does not hold the prompts behind it for its whole prefill (--prefill-chunk-tokens;
    None: never chunk)."""
    max_waiting_prefills: int = 64
    """Requests admitted and not yet prefilled, at most; beyond it RESOURCE_EXHAUSTED (--max-waiting-prefills)."""
    max_waiting_prompt_tokens: int = 65536
    """Prompt tokens of those requests, at most; beyond it RESOURCE_EXHAUSTED (--max-waiting-prompt-tokens)."""
    scheduling_policy: str = "fcfs"
    """vLLM's --scheduling-policy: waiting prompts in arrival order (fcfs), or by their request's
    priority first (priority); `epd.stages.scheduling`."""

    def __post_init__(self) -> None:
        check_scheduling_policy(self.scheduling_policy)
        if self.max_prefill_tokens_per_step < 1:
            raise ValueError(
                "max_prefill_tokens_per_step (--max-prefill-tokens-per-step) must be >= 1, "
                f"got {self.max_prefill_tokens_per_step}"
            )
        if self.prefill_chunk_tokens is not None and not (
            1 <= self.prefill_chunk_tokens <= self.max_prefill_tokens_per_step
        ):
            raise ValueError(
                "prefill_chunk_tokens (--prefill-chunk-tokens) must be between 1 and "
                f"--max-prefill-tokens-per-step ({self.max_prefill_tokens_per_step}), "
                f"got {self.prefill_chunk_tokens}"
            )
        if self.max_waiting_prefills < 1 or self.max_waiting_prompt_tokens < 1:
            raise ValueError(
                "max_waiting_prefills (--max-waiting-prefills) and max_waiting_prompt_tokens "
                "(--max-waiting-prompt-tokens) must be >= 1"
            )


@dataclass(frozen=True)
class PrefillConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    advertise_address: str = ""
    """host:port the decode service pulls KV caches from; default host:port of `server`."""
    max_prompt_tokens: int = 32768
    """Prompts longer than this (text + visual tokens) are refused (--max-prompt-tokens). A bound on
    one prompt's prefill memory and time; `max_model_len` (or the model's context) bounds it too."""
    max_text_chars: int = 262_144
    """Characters of text in the whole conversation (history included) at most: a bound on what
    the tokenizer is given before the prompt's tokens are counted (`max_prompt_tokens` is the
    bound that matters; 4,096 refused a follow-up at its 29th turn, at 2,730 tokens)."""
    kv_store_bytes: int = 4 << 30
    """KV caches waiting to be pulled may hold at most this many bytes; beyond it new prefills are
    refused with RESOURCE_EXHAUSTED until decoders catch up."""
    kv_ttl_s: float = 120.0
    """A KV cache nobody pulls within this time is dropped."""
    max_new_tokens_limit: int = MAX_NEW_TOKENS
    """The most tokens a request may ask for (OpenAI's max_tokens; --max-new-tokens-limit, at most
    MAX_NEW_TOKENS, decode's own bound). The gateway learns it (`ModelInfo.max_new_tokens`) and
    refuses a request over it before its media costs an encode."""
    max_logprobs: int = MAX_LOGPROBS
    """vLLM's --max-logprobs: the most top tokens a request may ask for at each position (chat
    completions' top_logprobs, legacy completions' logprobs); more is refused with INVALID_ARGUMENT.
    The gateway learns it (`ModelInfo.max_logprobs`) and refuses more before the media's encode."""
    max_model_len: int | None = None
    """vLLM's --max-model-len: prompt plus generated tokens at most. None: the model's own context
    (config.json's max_position_embeddings). It may only lower that (`served_context`); the context
    check, the prompt limit and /v1/models' `max_model_len` follow the context it leaves."""
    max_transfer_bytes: int = 1 << 30
    """Largest visual-embedding upload accepted."""
    scheduler: PrefillSchedulerConfig = field(default_factory=lambda: PrefillSchedulerConfig())
    """The prefill core's queue bounds, token budget per step and chunk size."""
    prefix_cache_bytes: int = 1 << 30
    """Prompt KV caches kept for follow-up questions about the same media (`prefill_svc/prefix_cache.py`)
    hold at most this many bytes, least recently used leaving first (--prefix-cache-bytes; 0: off)."""
    prefix_cache_ttl_s: float = 600.0
    """A prefix-cache entry unused for this long is dropped (--prefix-cache-ttl)."""
    chat_template: str | None = None
    """vLLM's --chat-template: the Jinja template that renders every prompt instead of the
    checkpoint's (the text; the flag's file is read where the flag is, `load_chat_template`).
    Checked here, so a template that does not parse stops the service at start, not at the first
    request. None: the checkpoint's own."""
    trust_request_chat_template: bool = False
    """vLLM's --trust-request-chat-template: a request's `chat_template` renders its prompt
    (refused with INVALID_ARGUMENT otherwise). A template is code run for the request: trust the
    clients with the server's CPU time and memory (a template may loop) before turning it on."""

    def __post_init__(self) -> None:
        if self.scheduler.max_waiting_prompt_tokens < self.max_prompt_tokens:
            raise ValueError(
                f"max_waiting_prompt_tokens (--max-waiting-prompt-tokens, {self.scheduler.max_waiting_prompt_tokens}) "
                f"must be >= max_prompt_tokens ({self.max_prompt_tokens}), or the longest prompt never gets in"
            )
        if self.max_prompt_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens (--max-prompt-tokens) must be >= 1 token, got {self.max_prompt_tokens}"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs (--max-logprobs) must be >= 0, got {self.max_logprobs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len (--max-model-len) must be >= 1 token, got {self.max_model_len}")
        if self.kv_store_bytes < 0:
            raise ValueError(f"kv_store_bytes (--kv-store-bytes) must be >= 0, got {self.kv_store_bytes}")
        if self.kv_ttl_s <= 0:
            raise ValueError(f"kv_ttl_s (--kv-ttl) must be > 0 seconds, got {self.kv_ttl_s}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(
                f"prefix_cache_bytes (--prefix-cache-bytes) must be >= 0, got {self.prefix_cache_bytes}"
            )
        if self.prefix_cache_ttl_s <= 0:
            raise ValueError(
                f"prefix_cache_ttl_s (--prefix-cache-ttl) must be > 0 seconds, got {self.prefix_cache_ttl_s}"
            )

        if self.chat_template is not None:
            from epd.model_runtime.chat_template import check_syntax

            try:
                check_syntax(self.chat_template)
            except ValueError as exc:
                raise ValueError(f"--chat-template: {exc}") from None

    def served_context(self, model_context: int | None) -> int | None:
        """Prompt plus generated tokens at most, as served: the model's context (`model_context`,
        None: not known), or `max_model_len` when set. ValueError for a `max_model_len` above the
        model's context, as vLLM refuses one (without VLLM_ALLOW_LONG_MAX_MODEL_LEN, which epd has
        no counterpart of): positions past max_position_embeddings were never trained, and a
        request using them gets garbage rather than an error."""
        if self.max_model_len is None:
            return model_context
        if model_context is not None and self.max_model_len > model_context:
            raise ValueError(
                f"--max-model-len {self.max_model_len} is more than this model's context of {model_context} "
                "tokens (config.json's max_position_embeddings); it may only lower it: pass at most "
                f"{model_context}, or leave it out"
            )
        return self.max_model_len

    def served_prompt_tokens(self, context: int | None) -> int:
        """The longest prompt served: `max_prompt_tokens`, or the served `context` when shorter
        (a longer one cannot fit in it at all)."""
        return self.max_prompt_tokens if context is None else min(self.max_prompt_tokens, context)
