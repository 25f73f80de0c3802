"""`epd`: ask a question about a video, or serve the stack.

    epd ask VIDEO (QUESTION | --messages FILE) [--endpoint HOST:PORT] [--json]
    epd ask VIDEO [QUESTION] --question Q2 ... [--interactive]   # one conversation, in turns
    epd ask --prompt TEXT         # a raw prompt, continued without the chat template (/v1/completions')
    epd serve                     # the whole stack on loopback, one process per service
    epd serve encoder|prefill|decode|gateway
    epd health HOST:PORT          # exit 0 when the service reports SERVING; 1 when it does not, or no answer
    epd bench serve|quality ...  # latency/throughput vs baselines; accuracy on the test split

Environment variables are read here and nowhere else: EPD_MODEL, EPD_DEVICE, EPD_DTYPE,
EPD_NUM_THREADS give the defaults of --model, --device, --dtype, --num-threads; EPD_API_KEY the
default of the gateway's --api-key; EPD_INTERNAL_SECRET_FILE of --internal-secret-file, and
EPD_INTERNAL_SECRET the internal secret itself when no file is given.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from epd import __version__
from epd.gateway.reasoning import REASONING_PARSERS
from epd.gateway.tool_parsers.stream import TOOL_CALL_PARSERS
from epd.stages.model_thread import CLOSE_WAIT_S

# `epd serve --encoders N ...`: replica i of a stage listens on the stage's port + STEP * i, so
# that the default ports' replicas (50051, 50061, ...; 50052, 50062, ...) never meet.
REPLICA_PORT_STEP = 10
MAX_REPLICAS = 64
MAX_PORT = 65535


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _num_threads(text: str) -> int:
    """--num-threads: a positive count, or "auto" (0)."""
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or auto, got {text!r}")
    return n


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
        type=_max_new_tokens_limit,
        default=PrefillConfig.max_new_tokens_limit,
        metavar="N",
        help=f"the most tokens a request may ask for (the OpenAI API's max_tokens; at most and by "
        f"default {MAX_NEW_TOKENS}): more is refused with 400 / INVALID_ARGUMENT, by the gateway "
        "before the request's media is decoded and encoded",
    )
    p.add_argument(
        "--max-logprobs",
        type=_max_logprobs,
        default=PrefillConfig.max_logprobs,
        metavar="N",
        help="vLLM's: the most top tokens a request may ask logprobs of at each position (chat "
        "completions' and responses' top_logprobs, completions' logprobs, prompt_logprobs; default 20); "
        "more is refused with 400 / "
        "INVALID_ARGUMENT. They are of the raw model distribution (vLLM's default logprobs mode)",
    )
    p.add_argument(
        "--max-model-len",
        type=_max_model_len,
        default=PrefillConfig.max_model_len,
        metavar="N",
        help="vLLM's: prompt plus generated tokens at most (1k = 1000, 1K = 1024; default: the "
        "model's context, config.json's max_position_embeddings, which it may only lower: a "
        "larger value is refused at start). A longer prompt, or one whose max_tokens would pass "
        "it, is refused; /v1/models reports it as max_model_len",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_tokens,
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


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=_env("EPD_MODEL", "default"),
        help="local directory or hub id of a checkpoint of a supported family (Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL, Qwen3.5, LLaVA-OneVision, GLM-4.1V, InternVL3/3.5 -hf; default: the embedded model)",
    )
    g.add_argument("--device", default=_env("EPD_DEVICE", "cpu"), help="cpu or cuda[:N]")
    g.add_argument(
        "--dtype", default=_env("EPD_DTYPE", "float32"), choices=["float32", "float16", "bfloat16"]
    )
    from epd.model_runtime.config import LINEAR_KERNELS, ModelConfig

    g.add_argument(
        "--linear-kernel",
        default="torch",
        choices=LINEAR_KERNELS,
        help="linear layers: torch's own (MKL on x86; the default, bit-identical to generate()), "
        "or onednn for calls of 16 rows or more (prefill, vision tower, wide decode steps): "
        "2.1x faster products on the AMD bench CPU (not on Intel), results within float32 rounding "
        "(docs/benchmarks.md, 'oneDNN linear layers')",
    )
    g.add_argument(
        "--structured-compile-timeout-s",
        type=_seconds,
        default=ModelConfig.structured_compile_timeout_s,
        metavar="S",
        help="how long a request's structured output (JSON schema, regex, grammar) may take to "
        "compile against the model's vocabulary (default 30; 0: no bound); longer is refused with "
        "400 / INVALID_ARGUMENT asking for a simpler one",
    )
    env_threads = _env("EPD_NUM_THREADS", "")
    g.add_argument(
        "--num-threads",
        type=_num_threads,
        default=_num_threads(env_threads) if env_threads else None,
        help="torch threads per model call: N, or auto (the cores the other stages' calls leave "
        "idle at that moment). Default: 1 per service of a stack (the fastest under load, "
        "docs/benchmarks.md), auto in --colocate",
    )


def add_allocator_flag(p: argparse.ArgumentParser) -> None:
    from epd.cli.allocator import ALLOCATORS

    p.add_argument(
        "--allocator",
        default="auto",
        choices=ALLOCATORS,
        help="memory allocator of the model processes: auto (tcmalloc when installed, else glibc's "
        "malloc), tcmalloc (or exit 2), system (as started). tcmalloc lowered the peak memory "
        "under load by 5-17%% at the same or a higher speed (docs/benchmarks.md, 'Memory allocator')",
    )


def add_generation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None, help="sampling's seed (default: a random one)")
    g.add_argument(
        "--priority",
        type=int,
        default=0,
        help="vLLM's request priority, lower served earlier, for a gateway whose stages run "
        "--scheduling-policy priority (with fcfs, anything but 0 is refused); embedded, the one "
        "request per turn has nothing to go ahead of (default 0)",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="after the answer, a table of each generated token's log-probability and the K most "
        "likely tokens' at its position (0: the token's own alone; at most the server's "
        "--max-logprobs, 20 by default; raw model distribution, vLLM's default)",
    )
    g.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="after the answer, a table of each prompt token's log-probability given the tokens "
        "before it, its rank and the K most likely tokens' there (vLLM's prompt_logprobs; bounded "
        "as --logprobs; not with --pruning)",
    )
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="vLLM's, over the prompt's and the output's tokens: > 1 discourages repeats (1 = off)",
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="when sampling, drop tokens below MIN_P x the top token's probability (0 = off)",
    )
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="no end-of-sequence, stop token or stop string before this many tokens (0 = off)",
    )
    g.add_argument(
        "--logit-bias",
        type=_logit_bias,
        action="append",
        default=[],
        metavar="TOKEN_ID=BIAS",
        help="add BIAS (in [-100, 100]) to a token's logit (repeatable)",
    )
    g.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        metavar="TOKEN_ID",
        help="stop when this token is generated (repeatable)",
    )
    g.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the stop string or stop token that ended the answer in it",
    )
    g.add_argument(
        "--allowed-token-id",
        type=int,
        action="append",
        default=[],
        metavar="TOKEN_ID",
        help="generate only tokens given with this flag (repeatable; default: every token)",
    )
    g.add_argument(
        "--bad-word",
        action="append",
        default=[],
        metavar="WORD",
        help="never generate this word, with or without a leading space (repeatable)",
    )
    # Structured outputs (vLLM's; xgrammar: pip install 'epd[structured]'): one constraint at most.
    c = g.add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema",
        type=_json_schema_file,
        default=None,
        metavar="FILE",
        help="answer with JSON that FILE's JSON Schema accepts (structured outputs)",
    )
    c.add_argument(
        "--json-object", action="store_true", help="answer with a JSON object (structured outputs)"
    )
    c.add_argument("--regex", default=None, help="answer with text REGEX matches whole (structured outputs)")
    c.add_argument(
        "--choice",
        action="append",
        default=None,
        help="answer with exactly one of these strings (repeatable; structured outputs)",
    )
    c.add_argument(
        "--grammar",
        type=_text_file,
        default=None,
        metavar="FILE",
        help="answer with text FILE's EBNF grammar accepts (xgrammar's form, start symbol root)",
    )


def _text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def _json_schema_file(path: str) -> str:
    """A JSON Schema file -> its compact JSON text (an object, or ArgumentTypeError)."""
    import json

    try:
        schema = json.loads(_text_file(path))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{path} must hold a JSON Schema object")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 1734=-100), got {text!r}") from None


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    from epd.video.types import SamplingOptions

    g = p.add_argument_group("frame sampling")
    # --fps unset is None, so that `epd ask` sends a rate only when one is asked for (a request
    # with fps and num_frames is refused); the services' default rate is SamplingOptions.fps.
    g.add_argument(
        "--fps",
        type=float,
        default=None,
        help=f"frames sampled per second of video (default {SamplingOptions.fps:g})",
    )
    g.add_argument("--max-frames", type=int, default=32)
    g.add_argument(
        "--num-frames",
        type=int,
        default=0,
        help="exactly N frames, uniformly (a service's default for requests that name neither; "
        "instead of --fps, here as in epd ask)",
    )
    g.add_argument(
        "--max-pixels", type=int, default=0, help="downscale frames above H*W pixels (0 = model default)"
    )


def _knob(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def add_pruning_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("token dropping and KV compression (off by default)")
    g.add_argument("--pruning", default="off", help="preset: off, light, budget25, balanced, aggressive")
    g.add_argument(
        "--pruning-knob",
        type=_knob,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one knob of token_pruning.PruningConfig (repeatable)",
    )


def add_decode_limit_flags(g) -> None:
    """The limits every decode of untrusted media obeys (`DecodeLimits`): the encoder's, and the
    gateway's for its web demo's thumbnails (`epd serve` gives both the same values)."""
    from epd.video.types import DecodeLimits

    g.add_argument(
        "--max-source-pixels",
        type=int,
        default=DecodeLimits.max_source_pixels,
        help="largest video frame or image, width x height, checked on every decoded frame",
    )
    g.add_argument(
        "--max-decoded-pixels",
        type=int,
        default=DecodeLimits.max_decoded_pixels,
        help="pixels one request may decode, every frame counted (at least 256x256 each)",
    )
    g.add_argument(
        "--max-duration-s",
        type=float,
        default=DecodeLimits.max_duration_s,
        help="longest video accepted, in seconds of its own timeline (clips are cut first)",
    )
    g.add_argument(
        "--max-demux-s",
        type=float,
        default=DecodeLimits.max_demux_s,
        help="seconds the demux (index) pass of one video may take",
    )
    g.add_argument(
        "--max-decode-s",
        type=float,
        default=DecodeLimits.max_decode_s,
        help="seconds the frame decoding of one request may take (all its decode workers)",
    )


def add_max_upload_bytes_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag for the encoder's and the gateway's upload limits (`epd serve` passes it to both)."""
    from epd.gateway.config import GatewayConfig

    p.add_argument(
        "--max-upload-bytes",
        type=int,
        default=GatewayConfig.max_upload_bytes,
        help="largest media file, in bytes: the gateway's gRPC uploads, data URLs and fetched media, "
        "and the encoder's uploads",
    )


def add_encoder_flags(p: argparse.ArgumentParser) -> None:
    from epd.video.parallel_decoder import ParallelDecodeConfig

    g = p.add_argument_group("encoder")
    add_max_upload_bytes_flag(g)
    g.add_argument(
        "--max-visual-tokens",
        type=int,
        default=16384,
        help="visual tokens one request may produce; checked after its first frame group",
    )
    add_decode_limit_flags(g)
    g.add_argument(
        "--index-cache-bytes",
        type=int,
        default=ParallelDecodeConfig.index_cache_bytes,
        help="memory of the cached keyframe indexes (LRU)",
    )
    g.add_argument("--decode-workers", type=int, default=0, help="video decode threads (0 = one per core)")
    g.add_argument(
        "--frames-per-group",
        type=int,
        default=2,
        help="encode frames in groups of N while later frames decode (even; 0 = no overlap)",
    )
    g.add_argument(
        "--cache-memory-bytes",
        type=int,
        default=2 << 30,
        help="multimodal token cache in memory (LRU); 0 disables it",
    )
    g.add_argument("--cache-dir", default="", help="directory of the on-disk token cache tier (default: off)")
    g.add_argument(
        "--decode-backend",
        choices=["pyav", "decord"],
        default="pyav",
        help="video decoder: parallel PyAV threads (default) or decord in a child process",
    )
    g.add_argument(
        "--max-concurrent-decodes",
        type=int,
        default=4,
        help="requests decoded at once, each on its own driver thread (their frame groups "
        "share batched vision-tower calls on the one model thread)",
    )
    g.add_argument(
        "--max-tower-jobs-per-request",
        type=int,
        default=4,
        help="frame groups one request may have queued for the vision tower: the next are "
        "preprocessed while the tower encodes, and one step encodes all waiting (1 = wait each)",
    )
    g.add_argument(
        "--merge-decoded-groups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="for a request that starts while no other is encoding, a frame group also takes the "
        "next groups already decoded (up to frames-per-group x max-tower-jobs-per-request "
        "frames): one tower call when decoding runs ahead",
    )
    g.add_argument(
        "--max-tower-patches-per-step",
        type=int,
        default=8192,
        help="patches one batched vision-tower call may take (frame groups of several "
        "requests; a larger group runs alone)",
    )
    g.add_argument(
        "--max-queued-decodes",
        type=int,
        default=16,
        help="requests that may wait for a decode slot; beyond, RESOURCE_EXHAUSTED at once",
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
role (`epd/cli/serve.py` `stage_flags`) or builds the colocated stage with (`epd/cli/configs.py`):
one definition per flag, so the role and the stack cannot drift apart."""
SHARED_STAGE_FLAGS: tuple[Callable[..., None], ...] = (add_scheduling_policy_flag,)
"""Flags every stage role takes, defined once on `epd serve` and passed to each role's replicas
(`epd/cli/serve.py` `stage_flags`) or the colocated stages."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _count(what: str, high: int, unit: str, low: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` ("expected `what`", "`low` to `high` `unit`")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high} {unit}, got {text!r}")
        return value

    return parse


def _max_new_tokens_limit(text: str) -> int:
    """An argparse type: 1 to MAX_NEW_TOKENS tokens (decode reserves KV room for that many at most)."""
    from epd.model_runtime.sampling import MAX_NEW_TOKENS

    return _count("a number of tokens", MAX_NEW_TOKENS, "tokens")(text)


def _max_logprobs(text: str) -> int:
    """An argparse type: 0 (a request may ask for its tokens' own logprobs, no top tokens) to 2**20
    top tokens a position (more than any vocabulary; a request is held to its model's too)."""
    return _count("a number of tokens", 1 << 20, "tokens", low=0)(text)


_TOKENS_WITH_SUFFIX = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _tokens(text: str) -> int:
    """An argparse type: a positive number of tokens, in vLLM's forms too: "32768", "32k" (32,000),
    "25.6k" (25,600), "32K" (32,768; a binary suffix, like no suffix, takes a whole number)."""
    match = _TOKENS_WITH_SUFFIX.fullmatch(text.strip())
    number, suffix = match.groups() if match else ("", "")
    if match is None or ("." in number and suffix not in _DECIMAL_SUFFIXES):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of tokens (32768, 32k or 32K), got {text!r}"
        )
    if suffix in _DECIMAL_SUFFIXES:
        value = int(float(number) * _DECIMAL_SUFFIXES[suffix])
    else:
        value = int(number) * _BINARY_SUFFIXES[suffix]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return value


def _max_model_len(text: str) -> int:
    """`_tokens`, and vLLM's -1 / auto (fit the GPU's memory) refused saying what to do instead."""
    if text.strip() in ("-1", "auto"):
        raise argparse.ArgumentTypeError(
            f"vLLM's {text.strip()} (the longest that fits the GPU's memory) is not "
            "supported: leave --max-model-len out to serve the model's own context"
        )
    return _tokens(text)


# Every port flag (0: the flag's own meaning, off or any free port). Left to the socket, 70001
# would be served as 70001 - 65536, and -5 would fail deep in bind, with a traceback.
_port = _count("a port number", MAX_PORT, "(a TCP port)", low=0)


def add_grace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grace-period",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT/SIGHUP, requests in flight get this long to finish before they are "
        "cut off (an idle service exits at once; a second signal, 1 s or more after the first, stops "
        "at once); then the service's threads get --close-timeout-s more",
    )
    add_close_timeout_flag(p)


def add_close_timeout_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--close-timeout-s",
        type=_seconds,
        default=CLOSE_WAIT_S,
        metavar="SECONDS",
        help="after the drain (or `epd ask`'s last answer), the threads still running (a model step, "
        "a prompt render, a video decode, a structured output's compile) get this long in all to end; "
        "one still running then is named in a warning and left to the exit (0: wait for none). A "
        "deployment's stop grace must cover --grace-period + this + 7 s (at least --grace-period + 12 s)",
    )


def add_server_flags(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=_port, default=default_port)
    add_grace_flag(p)
    add_security_flags(p)


def add_tls_client_flags(g) -> None:
    g.add_argument(
        "--tls-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle verifying the stage servers this service calls: set, its channels to "
        "them use TLS, presenting --tls-cert/--tls-key as client certificate (mTLS)",
    )
    g.add_argument(
        "--tls-cert",
        default="",
        metavar="PATH",
        help="PEM certificate chain this service presents (its gRPC and HTTP ports; and to stages)",
    )
    g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-server-name",
        default="",
        metavar="NAME",
        help="name the called servers' certificates are checked against instead of the host dialed "
        "(decode reaching prefill pods by IP: the name their certificate carries); needs --tls-ca",
    )


def add_security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (docs/security.md)")
    add_tls_client_flags(g)
    g.add_argument(
        "--tls-client-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle client certificates must chain to: every client then needs one (mTLS)",
    )
    g.add_argument(
        "--internal-secret-file",
        default=_env("EPD_INTERNAL_SECRET_FILE", ""),
        metavar="PATH",
        help="file holding the shared secret stages require on every call but health (the gateway "
        "and decode present it); several, one a line, while it rotates: the first is "
        "presented, every one accepted (docs/security.md); default: $EPD_INTERNAL_SECRET_FILE, "
        "else the secret itself in $EPD_INTERNAL_SECRET. A stage refuses to start without one "
        "unless --tls-client-ca (mTLS) or --insecure-no-internal-auth (`epd serve` gives its own one)",
    )
    add_secret_check_flag(g)
    g.add_argument(
        "--insecure-no-internal-auth",
        action="store_true",
        help="serve a stage to any caller that reaches its port, without the internal secret: "
        "development on a closed machine or network only",
    )
    p.set_defaults(internal_secret_env=_env("EPD_INTERNAL_SECRET", ""))


def _secret_check_interval(text: str) -> float:
    value = _positive_seconds(text)
    if value == float("inf"):  # the file would never be looked at again: no rotation
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    return value


def add_secret_check_flag(g) -> None:
    """Every service's (`add_security_flags`), and `epd serve`'s, which passes it to the stack's
    services (`epd.cli.serve.stack_security_flags`; --colocate has no internal secret)."""
    from epd.stages.server_config import SECRET_CHECK_INTERVAL_S

    g.add_argument(
        "--secret-check-interval-s",
        type=_secret_check_interval,
        default=SECRET_CHECK_INTERVAL_S,
        metavar="SECONDS",
        help="how often the internal secret file is looked at (a stat; re-read when it changed): "
        "a rotation step is in effect everywhere this long after the file changed "
        f"(default {SECRET_CHECK_INTERVAL_S:g}; docs/security.md)",
    )


def add_stack_security_flags(p: argparse.ArgumentParser) -> None:
    """`epd serve` (the stack, or --colocate): the front door's keys and limits, and TLS."""
    g = p.add_argument_group("front door and TLS (the stack or --colocate; docs/security.md)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on the gateway (default: $EPD_API_KEY); repeatable, "
        "each key its own cache tenant (handed to the gateway in a 0600 file, not its command line)",
    )
    g.add_argument("--api-key-file", default="", metavar="PATH", help="more API keys, one per line")
    g.add_argument(
        "--max-requests-per-api-key",
        type=int,
        default=0,
        help="requests one API key may have in flight over all its clients (0 = no limit)",
    )
    g.add_argument(
        "--tls-cert",
        default="",
        metavar="PATH",
        help="PEM certificate (valid for 127.0.0.1) every service serves: the gateway's gRPC and "
        "HTTP ports become TLS/HTTPS, and the stages take only the stack's own calls (mTLS)",
    )
    g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-ca",
        default="",
        metavar="PATH",
        help="PEM CA that signed --tls-cert (a self-signed certificate is its own CA); needed with it",
    )
    g.add_argument(
        "--tls-client-ca",
        default="",
        metavar="PATH",
        help="PEM CA bundle clients of the gateway must present a certificate of (mTLS at the front door)",
    )
    add_secret_check_flag(g)
    p.set_defaults(api_key_env=_env("EPD_API_KEY", ""))


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
    g.add_argument(
        "--routing",
        choices=("affinity", "round-robin"),
        default="affinity",
        help="affinity: a video's calls go to the replicas holding its caches (unless "
        "overloaded), others to the least loaded; round-robin: every call in turn",
    )
    g.add_argument(
        "--stage-attempt-timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="longest one try of a stage call may take (decode: until its first token) before "
        "the next replica is tried (0 = only the stage deadline)",
    )
    g.add_argument(
        "--load-refresh-interval",
        type=_seconds,
        default=0.5,
        metavar="SECONDS",
        help="seconds between reads of the replicas' loads for routing (0 = off)",
    )


def _addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def _kv_sources(value: str) -> tuple[str, ...]:
    from epd.decode_svc.kv_sources import parse_allow_list

    entries = _addresses(value)
    try:
        parse_allow_list(entries)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def add_http_listen_flags(p: argparse.ArgumentParser, g) -> None:
    """Where the gateway's HTTP API listens and who may call it: `epd serve gateway` only (`epd
    serve` listens on loopback alone, with its own --http-port and the keys of
    `add_stack_security_flags`)."""
    g.add_argument("--http-port", type=_port, default=0, help="port of the HTTP API (0 = off)")
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
    p.set_defaults(api_key_env=_env("EPD_API_KEY", ""))
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
        type=_addresses,
        default=(),
        help="comma-separated domains http(s) media URLs may be fetched from (default: none); "
        "private addresses are refused regardless",
    )
    g.add_argument(
        "--media-fetch-timeout", type=_positive_seconds, default=30.0, help="seconds to fetch one media URL"
    )
    g.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=300.0,
        metavar="SECONDS",
        help="seconds a request body may take to arrive, whole (HTTP 408 past it)",
    )
    g.add_argument(
        "--sse-keepalive",
        type=_seconds,
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


class _Parser(argparse.ArgumentParser):
    """argparse, except that a flag it does not know is reported as an unknown flag. Left alone,
    `epd serve --bad-flag x` skips the unknown flag, takes `x` for the role and says "argument
    role: invalid choice: 'x'", which points at the wrong word."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._arg_strings = list(args) if args is not None else None
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        if "invalid choice" in message and getattr(self, "_arg_strings", None):
            unknown = [
                a
                for a in self._arg_strings
                if a.startswith("-") and a != "--" and a.split("=", 1)[0] not in self._option_string_actions
            ]
            if unknown:
                message = f"unknown flag {unknown[0]} (see {self.prog} --help)"
        super().error(message)


GATEWAY_FLAGS: tuple[Callable[..., None], ...] = (
    add_admission_flags,
    add_routing_flags,
    functools.partial(add_http_api_flags, listen=False),
)
"""The gateway role's flags `epd serve` takes too: one definition each, passed to the stack's
gateway (`epd/cli/serve.py` `gateway_flags`) or built into the colocated front door's config
(`epd/cli/configs.py` `colocated_gateway_config`; routing excepted, its stages being local)."""


def build_parser() -> argparse.ArgumentParser:
    from epd.decode_svc.config import DEFAULT_PORT as DECODE_PORT
    from epd.decode_svc.config import TTFT_FIRST_DECODE_NICE, DecodeConfig
    from epd.encoder_svc.config import DEFAULT_PORT as ENCODER_PORT
    from epd.gateway.config import DEFAULT_PORT as GATEWAY_PORT
    from epd.gateway.config import MAX_CONCURRENT_STEPS, SCHEDULES, SharedModelSchedule, WebDemoConfig
    from epd.gateway.dns_replicas import DNS_REFRESH_INTERVAL_S
    from epd.prefill_svc.config import DEFAULT_PORT as PREFILL_PORT

    parser = _Parser(prog="epd", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"epd {__version__}")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: one line per record ending in request_id=ID when it is about a request; "
        "json: one JSON object per line (ts, level, logger, message, request_id)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    ask = sub.add_parser("ask", help="ask a question about a video or image")
    ask.add_argument(
        "video",
        nargs="?",
        default=None,
        help="path of a video (MP4, MKV, WebM, MOV, AVI) or image; with --no-video, the question",
    )
    ask.add_argument(
        "--no-video",
        action="store_true",
        help="a text-only conversation, no media: `epd ask --no-video QUESTION` (or --messages FILE "
        "without a video or image part); no encoder runs",
    )
    ask.add_argument(
        "question",
        nargs="?",
        default=None,
        help="the question (one user message: the media, then this text); with --question "
        "or --interactive, the conversation's first question",
    )
    ask.add_argument(
        "--question",
        dest="questions",
        action="append",
        default=[],
        metavar="Q",
        help="a question asked in turn (repeatable): one conversation, each turn sending the "
        "earlier questions and answers too; one answer (--json: one object) per turn",
    )
    ask.add_argument(
        "--interactive",
        action="store_true",
        help="then read questions from stdin, one a line, until EOF or an empty line, "
        "continuing the same conversation",
    )
    ask.add_argument(
        "--messages",
        default="",
        metavar="FILE",
        help="instead of QUESTION, a JSON file (- for stdin) holding the conversation: "
        '[{"role": "user", "content": [{"type": "text", "text": "..."}, {"type": "video"}]}], '
        "roles system/user/assistant, parts in your order, one video or image part (none with --no-video)",
    )
    ask.add_argument(
        "--continue-final-message",
        action="store_true",
        help="with --messages FILE ending with the assistant's message: continue that message "
        "(vLLM's continue_final_message; implies --no-add-generation-prompt); the answer is "
        "the continuation alone",
    )
    ask.add_argument(
        "--chat-template-kwargs",
        default="",
        metavar="JSON",
        help="extra variables of the model's chat template, a JSON object (vLLM's chat_template_kwargs): "
        """'{"enable_thinking": false}' closes a Qwen3.5 template's thinking block; variables the """
        "template does not read are dropped; not with --prompt",
    )
    ask.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="embedded mode: the Jinja chat template that renders the prompt instead of the "
        "model's own, a file's path or the template's text (as `epd serve --chat-template`); not "
        "with --prompt, which has no template",
    )
    ask.add_argument(
        "--no-add-generation-prompt",
        action="store_true",
        help="with --messages FILE: render the conversation without the chat template's opening "
        "of a new answer (vLLM's add_generation_prompt false)",
    )
    ask.add_argument(
        "--prompt",
        default=None,
        metavar="TEXT",
        help="instead of VIDEO and QUESTION, a raw prompt continued as it is, without the chat template "
        "(the HTTP API's /v1/completions): tokenised as the model's tokenizer(TEXT), no media",
    )
    ask.add_argument("--endpoint", default="", help="HOST:PORT of a running gateway; default: embedded")
    ask.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help="the deadline of each question, as the OpenAI client's timeout: every stage drops its "
        "work when it passes, and epd ask says so and exits 124 (default: none embedded; with "
        "--endpoint, the SDK's 600 s, the gRPC call's deadline)",
    )
    ask.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ask.add_argument(
        "--api-key",
        default=_env("EPD_API_KEY", ""),
        help="key of a gateway started with --api-key (default: $EPD_API_KEY)",
    )
    ask.add_argument(
        "--cache-salt",
        default="",
        metavar="SALT",
        help="share cached video tokens and prompt prefixes only with requests of the same salt "
        "(vLLM's cache_salt; a gateway with API keys adds the key's own)",
    )
    g = ask.add_argument_group("tool calling (the chat API's tools and tool_choice, vLLM's meanings)")
    g.add_argument(
        "--tools",
        default="",
        metavar="FILE",
        help='a JSON file holding a list of OpenAI function tools, [{"type": "function", "function": '
        '{"name", "description", "parameters"}}], rendered into the prompt by the chat template; the '
        "answer's calls are printed (--json: content and tool_calls, as the chat API's message)",
    )
    g.add_argument(
        "--tool-choice",
        default=None,
        metavar="CHOICE",
        help="auto (the default with --tools: the calls the model writes, read by --tool-call-parser), "
        "required (forced to one call or more), a function's name (forced to its arguments) or none "
        "(the tools in the prompt, the answer unparsed)",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how the model writes tool calls, as `epd serve --tool-call-parser` (hermes: Qwen2.5, "
        "Qwen3 and Qwen3-VL; qwen3_coder: Qwen3-Coder and Qwen3.5); needed by --tool-choice auto",
    )
    g.add_argument(
        "--no-parallel-tool-calls",
        dest="parallel_tool_calls",
        action="store_false",
        help="keep the answer's first tool call alone (the chat API's parallel_tool_calls: false, vLLM's)",
    )
    g = ask.add_argument_group("TLS (--endpoint of a gateway started with --tls-cert)")
    g.add_argument(
        "--tls-ca", default="", metavar="PATH", help="PEM CA that signed the gateway's certificate"
    )
    g.add_argument(
        "--tls-cert",
        default="",
        metavar="PATH",
        help="PEM client certificate, for a gateway started with --tls-client-ca (mTLS)",
    )
    g.add_argument("--tls-key", default="", metavar="PATH", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-server-name",
        default="",
        metavar="NAME",
        help="name to check the gateway's certificate against, when not the --endpoint host "
        "(TLS: with the system's CAs when no --tls-ca)",
    )
    add_model_flags(ask)
    add_close_timeout_flag(ask)  # embedded mode: how long its close waits for its threads
    add_generation_flags(ask)
    add_sampling_flags(ask)
    add_pruning_flags(ask)

    # No abbreviations: the roles' own flags (`serve gateway --encoder A`) would read as ambiguous
    # abbreviations of the stack's (--encoder-port, --encoders) before the role's parser sees them.
    serve = sub.add_parser("serve", help="run the stack (default) or one service", allow_abbrev=False)
    roles = serve.add_subparsers(dest="role")
    for role, port in (("encoder", ENCODER_PORT), ("prefill", PREFILL_PORT), ("decode", DECODE_PORT)):
        r = roles.add_parser(role, help=f"run the {role} service")
        add_server_flags(r, port)
        add_model_flags(r)
        add_allocator_flag(r)
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
                type=_kv_sources,
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
    gw = roles.add_parser("gateway", help="run the front door")
    gw.set_defaults(allocator=None)  # no model, no torch: not the `serve` parser's --allocator default
    add_server_flags(gw, GATEWAY_PORT)
    gw.add_argument(
        "--encoder",
        type=_addresses,
        default=(f"127.0.0.1:{ENCODER_PORT}",),
        help="comma-separated encoder replica addresses (a video goes to the one its sha256 "
        "picks, so its cached tokens are found)",
    )
    gw.add_argument("--prefill", type=_addresses, default=(f"127.0.0.1:{PREFILL_PORT}",))
    gw.add_argument("--decode", type=_addresses, default=(f"127.0.0.1:{DECODE_PORT}",))
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
        type=_seconds,
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
        type=_seconds,
        default=DNS_REFRESH_INTERVAL_S,
        metavar="SECONDS",
        help="seconds between lookups of dns:///NAME:PORT stage addresses, each routed as one replica "
        "per address NAME resolves to (0 = a name found is not looked up again)",
    )
    add_admission_flags(gw)
    add_routing_flags(gw)
    add_http_api_flags(gw)  # with its listen flags: GATEWAY_FLAGS' without them
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
    # `epd serve` with no role: the whole stack on loopback.
    serve.set_defaults(internal_secret_env=_env("EPD_INTERNAL_SECRET", ""))  # else the stack makes one
    # The HTTP API on the gRPC port's interface (loopback) and keys required only where the gateway
    # would refuse to listen without: `epd serve` has no flags to listen beyond loopback.
    serve.set_defaults(http_host="", no_api_key=False)
    serve.add_argument("--gateway-port", type=_port, default=GATEWAY_PORT)
    serve.add_argument("--encoder-port", type=_port, default=ENCODER_PORT)
    serve.add_argument("--prefill-port", type=_port, default=PREFILL_PORT)
    serve.add_argument("--decode-port", type=_port, default=DECODE_PORT)
    serve.add_argument(
        "--http-port",
        type=_port,
        default=8000,
        help="OpenAI-compatible HTTP API and web demo on the gateway (0 = off)",
    )
    serve.add_argument(
        "--demo-max-concurrent-decodes",
        type=int,
        default=WebDemoConfig.max_concurrent_decodes,
        help="web demo decodes at once in the gateway, on their own threads; more get 429",
    )
    g = serve.add_argument_group("replicas and supervision (the stack on loopback)")
    replicas = _count("a number of replicas", MAX_REPLICAS, "replicas")
    for role in ("encoder", "prefill", "decode"):
        g.add_argument(
            f"--{role}s",
            type=replicas,
            default=1,
            metavar="N",
            help=f"{role} replicas: replica i listens on --{role}-port + {REPLICA_PORT_STEP} * i",
        )
    g.add_argument(
        "--health-timeout",
        type=_positive_seconds,
        default=10.0,
        metavar="SECONDS",
        help="a service that stops answering its gRPC health check this long is killed and "
        "restarted (a service that exits is restarted too, with backoff; one that "
        "crash-loops is given up on)",
    )
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
    serve.add_argument(
        "--decode-max-wait-s",
        type=_positive_seconds,
        default=shared.decode_max_wait_s,
        metavar="SECONDS",
        help="--colocate with --schedule ttft-first: longest a decode step "
        "waits while encode and prefill steps go first",
    )
    steps = _count("a number of model calls", MAX_CONCURRENT_STEPS, "(one per stage)")
    serve.add_argument(
        "--concurrent-steps",
        type=steps,
        default=shared.concurrent_steps,
        metavar="N",
        help=f"--colocate: model calls of different stages that run at once (1: one at a time; "
        f"2: a decode step beside an encode or prefill step; at most {MAX_CONCURRENT_STEPS}, "
        "one per stage)",
    )
    add_stack_security_flags(serve)
    add_grace_flag(serve)  # passed to every service; the gateway drains first, then the stages
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
    add_allocator_flag(serve)  # the launcher's choice; the stack's services inherit it (LD_PRELOAD)

    bench = sub.add_parser("bench", help="benchmarks: serve (latency/throughput), quality (accuracy)")
    bench.add_argument("suite", choices=["serve", "quality"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the suite's own flags (--help)")

    health = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    health.add_argument("address", help="HOST:PORT")
    health.add_argument("--service", default="", help="service name; default: the whole server")
    health.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=3.0,
        metavar="SECONDS",
        help="seconds to wait for the answer",
    )
    add_tls_client_flags(health.add_argument_group("TLS (a service started with --tls-cert)"))
    return parser


SECRET_FLAGS = ("--api-key",)
"""Flags whose value is a secret: hidden from this process's command line as `ps` shows it."""


def hide_secrets(argv: list[str]) -> list[str] | None:
    """`argv` with every SECRET_FLAGS value replaced by ***, or None when it holds none."""
    shown, hidden = list(argv), False
    for i, word in enumerate(argv):
        name, eq, _ = word.partition("=")
        if name in SECRET_FLAGS and eq:
            shown[i], hidden = f"{name}=***", True
        elif word in SECRET_FLAGS and i + 1 < len(argv):
            shown[i + 1], hidden = "***", True
    return shown if hidden else None


def _hide_secrets_from_ps() -> None:
    """Every local user reads a process's command line (`ps`, /proc/PID/cmdline): an API key given
    as `--api-key KEY` showed there for as long as the gateway (or `epd serve`, `epd ask`) ran.
    Rewritten as soon as the flags are parsed; $EPD_API_KEY or --api-key-file never show at all."""
    shown = hide_secrets(sys.argv[1:])
    if shown is None:
        return
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(["epd", *shown]))


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


def parse_command(argv: list[str] | None = None) -> argparse.Namespace:
    """`epd`'s command line (`argv`, or the process's own) parsed, or exit 2 saying what to change."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    if args.command == "serve" and args.role and (early := flags_before_role(given)):
        parser.error(
            f"{' '.join(early)} before the role {args.role!r} would be ignored: a service's flags come "
            f"after its role (epd serve {args.role} {early[0]} ...)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_command(argv)
    if argv is None:  # the process's own command line (not a test's or the zygote's call)
        _hide_secrets_from_ps()
    from epd.transport.tracing import configure_logging

    configure_logging(args.log_level, args.log_format)  # the request id in every line about a request
    if args.command == "ask":
        from epd.cli.ask import run_ask

        code = run_ask(args)  # printed, flushed, its pipeline closed
        if argv is None:  # the command's own process (`epd.cli.process_exit`), as `epd serve`'s
            from epd.cli.process_exit import exit_now

            exit_now(code)
        return code
    if args.command == "bench":
        if args.suite == "serve":
            from epd.bench.serve import main as bench_main
        else:
            from epd.bench.quality import main as bench_main
        return bench_main(args.bench_args)
    if args.command == "health":
        from epd.cli.configs import health_security
        from epd.cli.health import check_health
        from epd.transport import security

        try:
            security.configure(health_security(args))
        except ValueError as exc:
            print(f"epd health: {exc}", file=sys.stderr)
            return 2
        return check_health(args.address, args.service, args.timeout)
    if argv is None and (allocator := getattr(args, "allocator", None)) is not None:
        from epd.cli.allocator import ensure_allocator

        if (error := ensure_allocator(allocator)) is not None:  # may run this command again, with tcmalloc
            print(f"epd serve: {error}", file=sys.stderr)
            return 2
    from epd.cli.serve import run_serve

    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
