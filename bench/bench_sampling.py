"""What vLLM's sampling options cost: the sampler alone, and the decode step they run in.

    PYTHONPATH=. python bench/bench_sampling.py
    PYTHONPATH=. python bench/bench_sampling.py --batch 8 --steps 24 --rounds 3 --threads 1

1. The sampler alone (`Sampler.__call__` on one request's logits, [vocab] float32, vocab 151,936
   as Qwen2-VL's), after a 300-token prompt and 64 output tokens: median microseconds per call
   for the default (greedy argmax) and each option (allowed_token_ids and bad_words included), and the ratio against the default measured
   in the same run (sampled configs against the default draw at temperature 1).
2. The decode step (`decode_batch` over `--batch` requests plus each request's `Generation.accept`:
   sampler and detokeniser) on bench_pruning's ~30M-parameter Qwen2-VL given Qwen2-VL's
   151,936-token vocabulary, every request with the default settings, then every request with
   all the penalties, logit bias and min_tokens on; the median step over `--rounds` rounds of
   `--steps` steps each, then every request with logprobs at vLLM's most (top_logprobs 20: the
   runner's `batch_logprobs` over the B rows, then each token's entry and texts), then (with
   xgrammar installed) every request with a structured-output constraint (an EBNF grammar of
   letters and spaces), the configs in turns, and of it the per-request part (logprobs, the B
   samplers and detokenisers after the forward), each with its ratio against the default.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_decode_batch import prompt_caches  # noqa: E402
from bench.bench_pruning import SPEC  # noqa: E402
from epd.decode_svc.engine import DecodeEngine  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.logprobs import MAX_LOGPROBS, batch_logprobs  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig, Sampler, StructuredOutputs  # noqa: E402
from epd.model_runtime.structured_output import grammar_compiler  # noqa: E402
from epd.model_runtime.tiny_model import build_checkpoint  # noqa: E402

QWEN_VOCAB = 151_936
PENALTIES = GenerationConfig(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                             logit_bias=((11, 5.0), (220, -5.0)), min_tokens=4)  # fmt: skip
"""Every penalty at once, greedy; the cases below `replace` onto it."""
UNENDING = StructuredOutputs(grammar="root ::= [a-z ] root")
"""A constraint with no end: letters and spaces, never the end-of-sequence token."""


def structured_outputs_installed() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


BAD_WORDS = [(7000 + i,) for i in range(8)] + [
    (output_id, 8000 + i) for i, output_id in enumerate(range(100, 108))
]
"""8 words as a tokenizer gives them (`tokenize_bad_words`): one token bare, two with a leading space."""
SAMPLER_CASES = [
    ("greedy (default)", GenerationConfig()),
    ("greedy + repetition_penalty", GenerationConfig(repetition_penalty=1.1)),
    ("greedy + presence + frequency", GenerationConfig(presence_penalty=0.5, frequency_penalty=0.5)),
    ("greedy + logit_bias (2 ids)", GenerationConfig(logit_bias=((11, 5.0), (220, -5.0)))),
    ("greedy + min_tokens (before it)", GenerationConfig(min_tokens=1000, max_new_tokens=1000)),
    ("greedy + all of them", PENALTIES),
    ("greedy + allowed_token_ids (1,000)", GenerationConfig(allowed_token_ids=tuple(range(5000, 6000)))),
    ("greedy + bad_words (8 words)", GenerationConfig(bad_words=("w",) * 8)),
    ("sampled t=1 (default)", GenerationConfig(temperature=1.0, seed=0)),
    ("sampled t=1 + min_p 0.05", GenerationConfig(temperature=1.0, seed=0, min_p=0.05)),
    ("sampled t=1 + all + min_p", replace(PENALTIES, temperature=1.0, seed=0, min_p=0.05)),
]


def median_ms(fn, repeats: int) -> float:
    fn()  # untimed: the penalties' [vocab] state is made at the first call
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_sampler(repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(QWEN_VOCAB, generator=generator) * 3
    prompt = torch.randint(0, QWEN_VOCAB, (300,), generator=generator).tolist()
    output = torch.randint(0, QWEN_VOCAB, (64,), generator=generator).tolist()
    print(f"1. sampler alone, vocab {QWEN_VOCAB:,}, 300 prompt + 64 output tokens, median of {repeats} calls")
    baseline: dict[str, float] = {}
    for name, config in SAMPLER_CASES:
        sampler = Sampler(
            config, 1, prompt, eos_token_ids={2}, bad_words_token_ids=BAD_WORDS if config.bad_words else ()
        )
        for token in output:
            sampler.seen(token)
        ms = median_ms(lambda s=sampler: s(logits), repeats)
        kind = "sampled" if config.temperature else "greedy"
        baseline.setdefault(kind, ms)
        print(f"   {name:34s} {ms * 1e3:8.1f} us  x{ms / baseline[kind]:.2f}")


def bench_decode_step(work_dir: Path, threads: int, batch: int, steps: int, rounds: int) -> None:
    model_dir = work_dir / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, replace(SPEC, vocab_size=QWEN_VOCAB))
    adapter = load_adapter(ModelConfig(model=str(model_dir), num_threads=threads), "decode")
    engine = DecodeEngine(adapter)
    caches = prompt_caches(adapter, batch)
    prompt_ids = list(range(1000, 1300))  # a prompt's distinct ids, for repetition_penalty
    print(
        f"2. decode step, {adapter.num_parameters / 1e6:.0f}M-parameter Qwen2-VL with vocab {QWEN_VOCAB:,}, "
        f"batch {batch}, {threads} thread(s), median of {rounds} rounds x {steps} steps"
    )

    grammar = None
    if constrained := structured_outputs_installed():
        # Letters and spaces without end (no end-of-sequence): every step is mid-answer.
        grammar = grammar_compiler(adapter).compile_now(UNENDING)
        # The prefill's token, one the grammar allows.
        first_token = adapter.tokenize("a", add_special_tokens=False)[0]
        caches = [(cache, positions, first_token) for cache, positions, _ in caches]

    def step_ms(config: GenerationConfig) -> tuple[float, float]:
        """(median ms of a whole step, median ms of its per-request part: sampler + detokeniser)."""
        kv = adapter.new_batch_kv()
        gens = []
        for cache, positions, token in caches:
            gen = engine.start(cache, token, [int(x) for x in positions], config, own_cache=False,
                               prompt_token_ids=prompt_ids,
                               grammar=grammar if config.structured_outputs else None)  # fmt: skip
            kv.add(cache, cache.num_cached_tokens + steps + 4)
            gens.append(gen)
        per_request: list[float] = []

        def step():
            positions = torch.stack([g.positions for g in gens], dim=1)  # [4, B]
            logits = adapter.decode_batch([g.last_token for g in gens], positions, kv)  # [B, vocab]
            t0 = time.perf_counter()
            rows = batch_logprobs(logits, [g.num_logprobs for g in gens])  # as DecodeRunner.execute
            for i, (g, row) in enumerate(zip(gens, logits, strict=True)):
                g.accept(row, rows.get(i))
            per_request.append(time.perf_counter() - t0)

        whole = median_ms(step, steps)
        return whole, statistics.median(per_request) * 1e3

    plain = GenerationConfig(max_new_tokens=1000, ignore_eos=True)
    penalised = replace(PENALTIES, max_new_tokens=1000, ignore_eos=True)
    with_logprobs = replace(plain, logprobs=MAX_LOGPROBS)
    results: dict[str, list[tuple[float, float]]] = {"default": [], "all penalties": [], "logprobs 20": []}
    order = [("default", plain), ("all penalties", penalised), ("logprobs 20", with_logprobs)]
    if constrained:
        results["structured output (EBNF)"] = []
        order.append(("structured output (EBNF)", replace(plain, structured_outputs=UNENDING)))
    for r in range(rounds):  # in turns, each first in turn: the machine's load drifts
        for name, config in order[r % len(order) :] + order[: r % len(order)]:
            results[name].append(step_ms(config))
    base = [statistics.median(v) for v in zip(*results["default"], strict=True)]
    for name, values in results.items():
        whole, part = (statistics.median(v) for v in zip(*values, strict=True))
        print(
            f"   {name:34s} step {whole:8.2f} ms  x{whole / base[0]:.3f}   of which per request "
            f"{part:6.2f} ms  x{part / base[1]:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=200, help="sampler calls per case")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-sampling"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench_sampler(args.repeats)
    bench_decode_step(args.work_dir, args.threads, args.batch, args.steps, args.rounds)


if __name__ == "__main__":
    main()
