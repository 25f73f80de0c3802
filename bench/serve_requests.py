"""What the serving benchmarks send and measure: the default questions, one request's timings
(`RequestResult`: TTFT, inter-token gaps, end to end) and their aggregate over a run (`summarize`:
mean and percentiles, request and token throughput, goodput). Shared by `epd bench serve`
(bench/serve.py) and bench/bench_vs_transformers_serve.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_QUESTIONS = [
    "what colour is the circle?",
    "how many objects are there in the video?",
    "which direction does the square move?",
    "what happens at the end?",
]


@dataclass
class RequestResult:
    ok: bool
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str = ""
    num_prompt_tokens: int = 0
    """As the server reported it (OpenAI usage; --openai only)."""
    server_timings: dict[str, float] = field(default_factory=dict)
    """The stack's own timings of the request, e.g. video_decode_ms, ttft_ms (`AskResult.timings_ms`;
    stack only)."""

    @property
    def tpot_ms(self) -> float:
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.e2e_ms - self.ttft_ms) / (self.num_output_tokens - 1)


def summarize(
    results: list[RequestResult], duration_s: float, ttft_slo_ms: float, tpot_slo_ms: float
) -> dict:
    """Aggregate statistics; percentiles over successful requests."""
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        arr = np.asarray(values, dtype=np.float64)
        return {
            "mean": float(arr.mean()),
            "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)),
            "p99": float(np.percentile(arr, 99)),
        }

    good = [r for r in done if r.ttft_ms <= ttft_slo_ms and r.tpot_ms <= tpot_slo_ms]
    num_tokens = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "duration_s": duration_s,
        "request_throughput_rps": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_token_throughput_tps": num_tokens / duration_s if duration_s > 0 else 0.0,
        "num_output_tokens": num_tokens,
        "goodput_rps": len(good) / duration_s if duration_s > 0 else 0.0,
        "num_good": len(good),
        "ttft_ms": stats([r.ttft_ms for r in done]),
        "tpot_ms": stats([r.tpot_ms for r in done if r.num_output_tokens > 1]),
        "itl_ms": stats([x for r in done for x in r.itl_ms]),
        "e2e_ms": stats([r.e2e_ms for r in done]),
        "errors": sorted({r.error for r in results if not r.ok}),
    }
