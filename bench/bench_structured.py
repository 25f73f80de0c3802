"""What a structured-output constraint costs per token: the sampler alone, with and without one.

    PYTHONPATH=. python bench/bench_structured.py

On a Qwen2-VL-sized vocabulary (151,936: bench_pruning's tiny Qwen2-VL checkpoint given that
vocabulary, its byte-level BPE tokenizer trained to it), the median microseconds of one greedy
`Sampler.__call__` on a [vocab] float32 row, for the default request (no constraint: the argmax)
and for one with a constraint (xgrammar's bitmask filled, applied to a copy of the row, the chosen
token accepted), with the ratio against the default measured in the same run; also the time to
compile the constraint against the vocabulary once, and again (xgrammar's cache). The regex
`[a-z ]*` never completes, and the end-of-sequence logit is -inf, so every timed call is a step
in the middle of an answer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pruning import SPEC  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig, Sampler, StructuredOutputs  # noqa: E402
from epd.model_runtime.structured_output import GrammarCompiler  # noqa: E402
from epd.model_runtime.tiny_model import build_checkpoint  # noqa: E402

QWEN_VOCAB = 151_936
CASES = [
    ("regex [a-z ]*", StructuredOutputs(regex="[a-z ]*")),
    ("EBNF word list", StructuredOutputs(grammar='root ::= "[" word ("," word)*\nword ::= [a-z]+')),
]


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_structured_"))
    model_dir = work_dir / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, replace(SPEC, vocab_size=QWEN_VOCAB))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, QWEN_VOCAB, {eos})
    logits = torch.randn(QWEN_VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[eos] = float("-inf")
    print(f"sampler alone, greedy, vocab {QWEN_VOCAB:,}, median of {args.repeats} calls")
    baseline = median_us(lambda s=Sampler(GenerationConfig()): s(logits), args.repeats)
    print(f"   {'no constraint (default)':28s} {baseline:9.1f} us  x1.00")
    for name, spec in CASES:
        t0 = time.perf_counter()
        grammar = compiler.compile_now(spec)
        cold_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        compiler.compile_now(spec)
        cached_ms = (time.perf_counter() - t0) * 1e3
        sampler = Sampler(GenerationConfig(structured_outputs=spec), grammar=grammar)
        us = median_us(lambda s=sampler: s(logits), args.repeats)
        print(
            f"   {name:28s} {us:9.1f} us  x{us / baseline:.2f}   "
            f"(compile {cold_ms:.0f} ms, again {cached_ms:.1f} ms)"
        )
    compiler.close()


if __name__ == "__main__":
    main()
