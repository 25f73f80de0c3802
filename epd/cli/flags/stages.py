"""The model stages' serving flags: prefill's KV store, prefix cache, scheduler, request limits and
chat template (`PrefillConfig`, `PrefillSchedulerConfig`), decode's KV memory, batch and queue
(`DecodeConfig`), every stage's scheduling policy; and `STAGE_FLAGS`, each stage role's flags,
which `epd serve` takes too."""

from __future__ import annotations

from collections.abc import Callable

from epd.cli.flags.arg_types import max_logprobs, max_model_len, max_new_tokens_limit, tokens
from epd.cli.flags.media import add_encoder_flags, add_sampling_flags


def add_prefix_cache_flags(p) -> None:
    from epd.prefill_svc.config import PrefillConfig

    p.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=PrefillConfig.prefix_cache_bytes,
        help="prompt KV kept for follow-up questions about the same media (the "
        "conversation's earlier turns are not prefilled again), least recently "
        "used leaving first (default: 1 GiB; 0: off)",
    )
    p.add_argument(
        "--prefix-cache-ttl",
        type=float,
        default=PrefillConfig.prefix_cache_ttl_s,
        help="seconds a prefix-cache entry is kept unused (default: 600)",
    )


def add_kv_store_flags(p) -> None:
    """Prefill's KV store, where prefilled caches wait for their decoder (the prefill role, and
    `epd serve` for its prefills or the colocated one)."""
    from epd.prefill_svc.config import PrefillConfig

    p.add_argument(
        "--kv-store-bytes",
        type=int,
        default=PrefillConfig.kv_store_bytes,
        help="KV caches waiting for decoders may hold this many bytes; beyond, new "
        "prefills get RESOURCE_EXHAUSTED (default: 4 GiB)",
    )
    p.add_argument(
        "--kv-ttl",
        type=float,
        default=PrefillConfig.kv_ttl_s,
        metavar="SECONDS",
        help="seconds a KV cache waits for a decoder before it is dropped (default: 120)",
    )


def add_prefill_scheduler_flags(p) -> None:
    """Prefill's step budget, chunk size and queue bounds (`PrefillSchedulerConfig`; the prefill
    role, and `epd serve` for its prefills or the colocated one)."""
    from epd.prefill_svc.config import PrefillSchedulerConfig

    sched = PrefillSchedulerConfig()
    p.add_argument(
        "--max-prefill-tokens-per-step",
        type=int,
        default=sched.max_prefill_tokens_per_step,
        help="prompt tokens one batched prefill step computes at most (vLLM's --max-num-batched-tokens)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=sched.prefill_chunk_tokens,
        help="prompts longer than this are prefilled in chunks of this many tokens, one "
        "chunk per step, so short prompts are not held behind them (0: never chunk)",
    )
    p.add_argument(
        "--max-waiting-prefills",
        type=int,
        default=sched.max_waiting_prefills,
        help="requests waiting for their prefill at most; more get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-waiting-prompt-tokens",
        type=int,
        default=sched.max_waiting_prompt_tokens,
        help="prompt tokens of the waiting requests at most; more get RESOURCE_EXHAUSTED",
    )


def add_prefill_limit_flags(p) -> None:
    """Prefill's bound on what a request may ask for (the prefill role, and `epd serve` for its
    prefills or the colocated one); the gateway learns it from prefill (`GetModelInfo`)."""
    from epd.model_runtime.sampling import MAX_NEW_TOKENS
    from epd.prefill_svc.config import PrefillConfig

    p.add_argument(
        "--max-new-tokens-limit",
        type=max_new_tokens_limit,
        default=PrefillConfig.max_new_tokens_limit,
        metavar="N",
        help=f"the most tokens a request may ask for (the OpenAI API's max_tokens; at most and by "
        f"default {MAX_NEW_TOKENS}): more is refused with 400 / INVALID_ARGUMENT, by the gateway "
        "before the request's media is decoded and encoded",
    )
    p.add_argument(
        "--max-logprobs",
        type=max_logprobs,
        default=PrefillConfig.max_logprobs,
        metavar="N",
        help="vLLM's: the most top tokens a request may ask logprobs of at each position (chat "
        "completions' and responses' top_logprobs, completions' logprobs, prompt_logprobs; default 20); "
        "more is refused with 400 / "
        "INVALID_ARGUMENT. They are of the raw model distribution (vLLM's default logprobs mode)",
    )
    p.add_argument(
        "--max-model-len",
        type=max_model_len,
        default=PrefillConfig.max_model_len,
        metavar="N",
        help="vLLM's: prompt plus generated tokens at most (1k = 1000, 1K = 1024; default: the "
        "model's context, config.json's max_position_embeddings, which it may only lower: a "
        "larger value is refused at start). A longer prompt, or one whose max_tokens would pass "
        "it, is refused; /v1/models reports it as max_model_len",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=tokens,
        default=PrefillConfig.max_prompt_tokens,
        metavar="N",
        help="prompt tokens (text and visual) at most; a longer prompt is refused with 413 / "
        "RESOURCE_EXHAUSTED before it is prefilled (default: 32768; --max-waiting-prompt-tokens "
        "must be at least as large). With --max-model-len, the smaller of the two bounds a prompt",
    )


def add_chat_template_flags(p) -> None:
    """vLLM's chat template flags (the prefill role, which renders prompts, and `epd serve` for its
    prefills or the colocated one)."""
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="vLLM's: the Jinja chat template that renders every prompt instead of the model's "
        "own: a file's path, or the template's text (backslash escapes such as \\n decoded, as "
        "vLLM's). A template that does not parse is refused at start",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="vLLM's: a request's chat_template field renders its prompt (otherwise refused with "
        "400 / INVALID_ARGUMENT). A template is code run for the request: trust the clients with "
        "the server's CPU time and memory first",
    )


def add_decode_scheduler_flags(p) -> None:
    """Decode's KV memory, batch size and queue bound (the decode role, and `epd serve` for its
    decoders or the colocated one)."""
    from epd.decode_svc.config import DecodeConfig

    p.add_argument(
        "--kv-budget-bytes",
        type=int,
        default=DecodeConfig.kv_budget_bytes,
        help="KV memory of the running batch (requests x the longest final length x "
        "bytes per token; vLLM's --kv-cache-memory-bytes); requests wait for room beyond it "
        "(default: 4 GiB)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=DecodeConfig.max_running_requests,
        help="requests decoding together in one batch at most (vLLM's --max-num-seqs): fewer "
        "keeps each running request's time per token lower under load, at the cost of "
        "the first tokens of the requests that wait",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DecodeConfig.max_waiting_requests,
        help="requests waiting for KV room at most; more get RESOURCE_EXHAUSTED",
    )


def add_scheduling_policy_flag(p) -> None:
    """vLLM's --scheduling-policy, of every stage (`epd.stages.scheduling`): `epd serve` passes
    its value to every replica of each stage, or the colocated stages; the gateway learns prefill's
    (`GetModelInfo`)."""
    from epd.stages.scheduling import SCHEDULING_POLICIES

    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="vLLM's: the order waiting requests are served in: fcfs (arrival; a request's priority "
        "must be 0) or priority (a request's priority first, lower first, then arrival); a "
        "running request is never preempted",
    )


STAGE_FLAGS: dict[str, tuple[Callable[..., None], ...]] = {
    "encoder": (add_sampling_flags, add_encoder_flags),
    "prefill": (
        add_kv_store_flags,
        add_prefix_cache_flags,
        add_prefill_scheduler_flags,
        add_prefill_limit_flags,
        add_chat_template_flags,
    ),
    "decode": (add_decode_scheduler_flags,),
}
"""Each stage role's own flags, which `epd serve` takes too and passes to every replica of the
role (`epd/cli/stack_commands.py` `stage_flags`) or builds the colocated stage with (`epd/cli/configs.py`):
one definition per flag, so the role and the stack cannot drift apart."""
SHARED_STAGE_FLAGS: tuple[Callable[..., None], ...] = (add_scheduling_policy_flag,)
"""Flags every stage role takes, defined once on `epd serve` and passed to each role's replicas
(`epd/cli/stack_commands.py` `stage_flags`) or the colocated stages."""
