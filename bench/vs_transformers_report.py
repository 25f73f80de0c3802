"""bench/bench_vs_transformers_serve.py's tables over its runs ({server name: run_server's
result}): each epd variant against transformers serve level by level (`side_by_side`), memory
and start-up (`memory_table`; "PSS after load, settled": once the services are idle and their idle
release has given memory back, `process_tree.settled`), and where each level's core-seconds went
(`cpu_table`)."""

from __future__ import annotations

from epd.bench.process_tree import MiB


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def side_by_side(runs: dict[str, dict]) -> list[str]:
    """Each epd variant against transformers serve, level by level (ratio = epd / transformers)."""
    t = runs["transformers"]
    rows = [
        "| server | in flight | epd req/s | transformers req/s | ratio | epd out tok/s | transformers out tok/s | "
        "ratio | epd TTFT p50 ms | transformers TTFT p50 ms | ratio | epd TPOT p50 ms | transformers TPOT p50 ms | "
        "ratio | errors epd / transformers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in runs.items():
        if name == "transformers":
            continue
        for le, lt in zip(e["sweep"], t["sweep"]):
            a, b = le["summary"], lt["summary"]
            rows.append(
                f"| {name} | {le['concurrency'] or 'all'} | {a['request_throughput_rps']:.2f} | "
                f"{b['request_throughput_rps']:.2f} | "
                f"{_ratio(a['request_throughput_rps'], b['request_throughput_rps'])} | "
                f"{a['output_token_throughput_tps']:.1f} | {b['output_token_throughput_tps']:.1f} | "
                f"{_ratio(a['output_token_throughput_tps'], b['output_token_throughput_tps'])} | "
                f"{a['ttft_ms']['p50']:.0f} | {b['ttft_ms']['p50']:.0f} | "
                f"{_ratio(a['ttft_ms']['p50'], b['ttft_ms']['p50'])} | "
                f"{a['tpot_ms']['p50']:.1f} | {b['tpot_ms']['p50']:.1f} | "
                f"{_ratio(a['tpot_ms']['p50'], b['tpot_ms']['p50'])} | "
                f"{a['num_failed']} / {b['num_failed']} |"
            )
    return rows


def memory_table(runs: dict[str, dict]) -> list[str]:
    rows = [
        "| server | processes (on tcmalloc) | PSS idle MiB | PSS peak during load MiB | PSS after load, settled MiB | "
        "start-up s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        rows.append(
            f"| {name} | {r['num_processes']} ({r.get('num_on_tcmalloc', 0)}) | {r['pss_idle'] / MiB:.0f} | "
            f"{r['pss_peak'] / MiB:.0f} | {r['pss_after'] / MiB:.0f} | {r['startup_s']:.1f} |"
        )
    t = runs.get("transformers")
    for name, e in runs.items():
        if t is None or name == "transformers":
            continue
        rows.append(
            f"| ratio {name} / transformers | | {_ratio(e['pss_idle'], t['pss_idle'])} | "
            f"{_ratio(e['pss_peak'], t['pss_peak'])} | {_ratio(e['pss_after'], t['pss_after'])} | "
            f"{_ratio(e['startup_s'], t['startup_s'])} |"
        )
    return rows


def cpu_table(runs: dict[str, dict]) -> list[str]:
    """Where each level's core-seconds went: per server and role, CPU seconds per request, and how
    many cores were busy on average (all roles' CPU time / the level's wall time)."""
    rows = ["| server | in flight | cores busy | CPU ms per request, by process |", "|---|---|---|---|"]
    for name, r in runs.items():
        for lv in r["sweep"]:
            cpu, n = lv.get("cpu_s") or {}, max(lv["summary"]["num_requests"], 1)
            busy = sum(cpu.values()) / lv["duration_s"] if lv.get("duration_s") else 0.0
            parts = ", ".join(f"{role} {t / n * 1e3:.0f}" for role, t in cpu.items())
            rows.append(f"| {name} | {lv['concurrency'] or 'all'} | {busy:.2f} | {parts} |")
    return rows
