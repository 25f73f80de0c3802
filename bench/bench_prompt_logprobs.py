"""What vLLM's `prompt_logprobs` costs prefill: one long text prompt, whole, without them and with
k = 0 and k = 20 (vLLM's most by default), the ratio against the plain prefill of the same run.

    PYTHONPATH=. python bench/bench_prompt_logprobs.py
    PYTHONPATH=. python bench/bench_prompt_logprobs.py --prompt-words 1500 --rounds 5 --threads 1

The model is bench_pruning's ~30M-parameter Qwen2-VL given Qwen2-VL's 151,936-token vocabulary,
so the lm head over every position (what prompt_logprobs adds: [L, hidden] x [hidden, vocab], then
a log_softmax, a rank and a top k over [L, vocab], PROMPT_LOGPROBS_CHUNK_BYTES at a time) weighs
what it weighs in the real model's proportion of head to layers. `whole_prefill.prefill_alone`, the
configs in turns each round, the median of `--rounds`.
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

from bench.bench_pruning import SPEC  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig  # noqa: E402
from epd.model_runtime.tiny_model import build_checkpoint  # noqa: E402
from epd.prefill_svc.config import PrefillConfig  # noqa: E402
from epd.prefill_svc.engine import PrefillEngine  # noqa: E402
from epd.prefill_svc.whole_prefill import prefill_alone  # noqa: E402
from epd.stages.messages import Message  # noqa: E402

QWEN_VOCAB = 151_936
CASES = [
    ("without prompt_logprobs", None),
    ("prompt_logprobs 0", 0),
    ("prompt_logprobs 20", 20),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-words", type=int, default=1000, help="words of the prompt's text")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-prompt-logprobs"))
    args = parser.parse_args()
    model_dir = args.work_dir / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, replace(SPEC, vocab_size=QWEN_VOCAB))
    model = ModelConfig(model=str(model_dir), num_threads=args.threads)
    torch.set_num_threads(args.threads)
    engine = PrefillEngine(PrefillConfig(model=model), load_adapter(model, "prefill"))
    words = " ".join(f"word{i % 97}" for i in range(args.prompt_words))
    messages = [Message.user(words)]

    def run(k: int | None) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = prefill_alone(engine, messages, None, GenerationConfig(max_new_tokens=1, prompt_logprobs=k))
        return (time.perf_counter() - t0) * 1e3, out.handle.num_prompt_tokens

    run(None)  # untimed: first-call allocations
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    num_tokens = 0
    for _ in range(args.rounds):
        for name, k in CASES:
            ms, num_tokens = run(k)
            times[name].append(ms)
    print(
        f"prefill of a {num_tokens}-token prompt, {engine.adapter.num_parameters / 1e6:.0f}M-parameter "
        f"Qwen2-VL with vocab {QWEN_VOCAB:,}, {args.threads} thread(s), median of {args.rounds} rounds"
    )
    base = statistics.median(times[CASES[0][0]])
    for name, _ in CASES:
        ms = statistics.median(times[name])
        print(f"   {name:26s} {ms:9.1f} ms  x{ms / base:.2f}")


if __name__ == "__main__":
    main()
