"""Tables and plot of the serving benchmarks' concurrency sweeps (a sweep: one
{"concurrency": c, "summary": summarize(...)} per level): one row per level (`sweep_table`), the
ratios of two sweeps of the same levels (`ratio_table`), and throughput, TTFT and TPOT against
concurrency (`write_plot`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def sweep_table(sweep: list[dict]) -> list[str]:
    """Markdown rows, one per concurrency level: [{"concurrency": c, "summary": summarize(...)}]."""
    rows = [
        "| in flight | ok | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for level in sweep:
        s = level["summary"]
        rows.append(
            f"| {level['concurrency'] or 'all'} | {s['num_completed']}/{s['num_requests']} | "
            f"{s['request_throughput_rps']:.3f} | {s['output_token_throughput_tps']:.1f} | "
            f"{s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['p50']:.1f} | "
            f"{s['tpot_ms']['p99']:.1f} | {s['num_failed']} |"
        )
    return rows


def ratio_table(name: str, base: list[dict], other: list[dict], prompt_tokens: bool = False) -> list[str]:
    """Markdown rows, one per level: `other`'s p50s and throughput over `base`'s (two sweeps of the
    same levels, run one after the other); with `prompt_tokens`, each series' median prompt tokens
    (as the server reported them) beside, to show that the two prompts are as long."""
    head = f"\n| ratio ({name}) | TTFT p50 | e2e p50 | TPOT p50 | req/s |"
    rows = [
        head + (" prompt tokens p50 |" if prompt_tokens else ""),
        "|---|---|---|---|---|" + ("---|" if prompt_tokens else ""),
    ]
    for b, o in zip(base, other, strict=True):
        sb, so = b["summary"], o["summary"]
        ratios = [so[k]["p50"] / max(sb[k]["p50"], 1e-9) for k in ("ttft_ms", "e2e_ms", "tpot_ms")]
        rps = so["request_throughput_rps"] / max(sb["request_throughput_rps"], 1e-9)
        row = (
            f"| {b['concurrency'] or 'all'} in flight | "
            + " | ".join(f"{r:.2f}x" for r in ratios)
            + f" | {rps:.2f}x |"
        )
        if prompt_tokens:
            counts = [
                float(np.median([r["num_prompt_tokens"] for r in lv["requests"]] or [0])) for lv in (b, o)
            ]
            row += f" {counts[0]:.0f} / {counts[1]:.0f} |"
        rows.append(row)
    return rows


def write_plot(path: str | Path, series: dict[str, list[dict]], title: str = "") -> None:
    """PNG of request and output-token throughput, TTFT and TPOT (p50 solid, p99 dashed) against
    concurrency, one line per series (e.g. {"epd": sweep, "transformers serve": sweep}).
    matplotlib is imported here only: the benchmark runs without it when no plot is asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    levels: set[int] = set()
    for i, (name, sweep) in enumerate(series.items()):
        colour = f"C{i}"
        xs = [lv["concurrency"] for lv in sweep]
        levels.update(xs)
        s = [lv["summary"] for lv in sweep]
        axes[0].plot(xs, [x["request_throughput_rps"] for x in s], "o-", color=colour, label=name)
        axes[1].plot(xs, [x["output_token_throughput_tps"] for x in s], "o-", color=colour, label=name)
        for ax, key in ((axes[2], "ttft_ms"), (axes[3], "tpot_ms")):
            ax.plot(xs, [x[key]["p50"] for x in s], "o-", color=colour, label=f"{name} p50")
            ax.plot(xs, [x[key]["p99"] for x in s], "s--", color=colour, alpha=0.6, label=f"{name} p99")
    labels = ("requests/s", "output tokens/s", "TTFT (ms)", "TPOT (ms)")
    for ax, label in zip(axes, labels):
        if levels and min(levels) > 0 and len(levels) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels))
        ax.set_xticklabels([str(c) for c in sorted(levels)])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
