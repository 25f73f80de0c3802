"""An idle stack's CPU: milliseconds of CPU per second of each process of a running `epd serve`
(or any server's process tree) while nothing is asked of it, over a window, several times.

    epd serve --model DIR --gateway-port 0 --encoder-port 0 --prefill-port 0 --decode-port 0 \
        --http-port auto &     # wait for "epd: stack ready", then:
    PYTHONPATH=. .venv/bin/python bench/bench_idle_cpu.py --pid LAUNCHER_PID --window-s 30 --reads 3

vLLM's and `transformers serve`'s idle servers take about none; what an idle epd stack still does
periodically, and why, is in docs/architecture.md ("What runs while the stack is idle")."""

from __future__ import annotations

import argparse
import time

from epd.bench.process_tree import tree_cpu_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pid", type=int, required=True, help="the launcher's (the tree's root) process id")
    p.add_argument("--window-s", type=float, default=30.0, help="seconds each read spans")
    p.add_argument("--reads", type=int, default=3)
    args = p.parse_args(argv)
    for read in range(args.reads):
        before, started = tree_cpu_s(args.pid), time.monotonic()
        time.sleep(args.window_s)
        after, elapsed_s = tree_cpu_s(args.pid), time.monotonic() - started
        rows = {key: (t - before[key]) * 1e3 / elapsed_s for key, t in after.items() if key in before}
        print(f"read {read + 1}: {sum(rows.values()):.1f} ms/s in all; " + ", ".join(
            f"{key} {ms:.1f}" for key, ms in sorted(rows.items(), key=lambda kv: -kv[1])
        ), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
