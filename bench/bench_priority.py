"""Priority scheduling: the TTFT of high-priority requests that arrive behind a burst of others.

    PYTHONPATH=. .venv/bin/python bench/bench_priority.py                 # epd serve, 8 low + 4 high
    PYTHONPATH=. .venv/bin/python bench/bench_priority.py --colocate      # epd serve --colocate

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (its SPEC with frames kept up to
    --clip-size x --clip-size; built once into --work-dir by bench/common.py's build_model), or
    --model DIR;
  * clips: --num-low + --num-high distinct synthetic clips (no request finds another's video in
    the encoder's token cache or prefill's prefix cache), plus one for warm-up;
  * twice, on a fresh `epd serve` each (`--scheduling-policy fcfs`, then `priority`), the same
    load: --num-low streaming chat requests sent at once (priority unset, 0; --low-max-tokens
    tokens each, ignore_eos), then, --high-delay-s after them and --high-interval-s apart,
    --num-high streaming requests of --high-max-tokens tokens; under `priority` these carry
    `"priority": -1` (lower is served earlier, vLLM's), under `fcfs` nothing (a non-zero priority
    is refused there);
  * printed: p50 TTFT (first streamed token, measured here) of the high and of the low requests
    under each policy, the wall time of the whole load, and the ratio of the high requests' p50
    TTFT under fcfs to that under priority.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from argparse import ArgumentParser, Namespace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    ask,
    bound_ports,
    build_model,
    data_url,
    log,
    make_clips,
    run_bench,
    server_command,
    start_server,
    stop,
    user,
    wait_ready,
)

POLICIES = ("fcfs", "priority")
HIGH = -1
QUESTION = "what moves in the video?"


def run_load(port: int, low: list[Path], high: list[Path], args, policy: str) -> dict[str, list[float]]:
    """TTFTs (ms) of the low and the high requests of one load; the wall time of it (s)."""
    ttfts: dict[str, list[float]] = {"low": [], "high": [], "wall_s": []}

    def one(kind: str, clip: Path, max_tokens: int, fields: dict) -> None:
        turn = ask(port, [user(QUESTION, data_url(clip))], _limits(max_tokens, args.num_frames),
                   args.timeout_s, fields=fields)  # fmt: skip
        ttfts[kind].append(turn.ttft_ms)

    high_fields = {"priority": HIGH} if policy == "priority" else {}
    threads = [threading.Thread(target=one, args=("low", c, args.low_max_tokens, {})) for c in low]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.high_delay_s)
    for k, clip in enumerate(high):
        if k:
            time.sleep(args.high_interval_s)
        t = threading.Thread(target=one, args=("high", clip, args.high_max_tokens, high_fields))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    ttfts["wall_s"].append(time.perf_counter() - t0)
    if len(ttfts["low"]) + len(ttfts["high"]) != len(low) + len(high):
        raise SystemExit("a request failed (its thread printed why)")
    return ttfts


def _limits(max_tokens: int, num_frames: int) -> Namespace:
    """The two fields of `args` that bench/common.py's `ask` reads."""
    return Namespace(max_tokens=max_tokens, num_frames=num_frames)


def serve(
    model: Path, policy: str, args, low: list[Path], high: list[Path], warm: Path
) -> dict[str, list[float]]:
    # One client sends them all: its limit must let every request in (the default is 8).
    limit = ["--max-requests-per-client", str(len(low) + len(high))]
    args.epd_arg = [*limit, *args.passed_epd_arg, "--scheduling-policy", policy]
    ports_file = args.work_dir / f"server-{policy}.ports.json"
    cmd, env = server_command(model, args, ports_file)
    log_path = args.work_dir / f"server-{policy}.log"
    with open(log_path, "w") as log_file:
        proc = start_server(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        launched = time.perf_counter()  # the stack names its ports once it is ready: count the wait
        port = bound_ports(ports_file, proc, args.timeout_s, log_path)["http"]
        log(
            f"{policy}: serving after {time.perf_counter() - launched + wait_ready(proc, port, args.timeout_s, log_path):.1f} s; warm-up"
        )
        ask(port, [user(QUESTION, data_url(warm))], _limits(2, args.num_frames), args.timeout_s)
        out = run_load(port, low, high, args, policy)
        log(f"{policy}: high TTFTs {[round(t) for t in sorted(out['high'])]} ms, "
            f"low {[round(t) for t in sorted(out['low'])]} ms, {out['wall_s'][0]:.1f} s")  # fmt: skip
        return out
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-priority"))
    p.add_argument("--model", default="", help="model directory (default: build the 27M Qwen2-VL)")
    p.add_argument("--num-low", type=int, default=8, help="low-priority requests sent at once")
    p.add_argument("--num-high", type=int, default=4, help="high-priority requests sent after them")
    p.add_argument("--low-max-tokens", type=int, default=64, help="tokens per low-priority answer")
    p.add_argument("--high-max-tokens", type=int, default=8, help="tokens per high-priority answer")
    p.add_argument("--high-delay-s", type=float, default=0.5, help="from the burst to the first high")
    p.add_argument("--high-interval-s", type=float, default=0.25, help="between high requests")
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--clip-size", type=int, default=224, help="clip width = height, px")
    p.add_argument("--threads", default="", help="epd serve --num-threads (default: epd's own)")
    p.add_argument("--colocate", action="store_true", help="epd serve --colocate (one process)")
    p.add_argument("--epd-arg", action="append", default=[], dest="passed_epd_arg",
                   help="a flag passed on to epd serve")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=600.0, help="start-up and per-request limit")
    args = p.parse_args(argv)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else args.work_dir / f"model-27m-{args.clip_size}px"
    if not model.exists():
        log(f"building the 27M Qwen2-VL (frames up to {args.clip_size}x{args.clip_size}) into {model}")
        build_model(model, args.clip_size * args.clip_size)
    clips = make_clips(args.work_dir / f"clips-{args.clip_size}px", 1 + args.num_low + args.num_high,
                       args.clip_size, 4.0)  # fmt: skip
    low, high, warm = clips[: args.num_low], clips[args.num_low : -1], clips[-1]
    runs = {policy: serve(model, policy, args, low, high, warm) for policy in POLICIES}

    print(f"\nepd serve{' --colocate' if args.colocate else ''}: {args.num_low} low-priority requests "
          f"({args.low_max_tokens} tokens) at once, {args.num_high} high-priority ({args.high_max_tokens} "
          f"tokens) from {args.high_delay_s} s after, {args.high_interval_s} s apart; {args.num_frames} "
          f"frames at {args.clip_size}x{args.clip_size}, streamed; model {model}")  # fmt: skip
    print(f"{'policy':9} {'high TTFT p50 ms':>16} {'low TTFT p50 ms':>15} {'wall s':>7}")
    for policy, run in runs.items():
        print(f"{policy:9} {statistics.median(run['high']):>16.0f} {statistics.median(run['low']):>15.0f} "
              f"{run['wall_s'][0]:>7.1f}")  # fmt: skip
    ratio = statistics.median(runs["fcfs"]["high"]) / statistics.median(runs["priority"]["high"])
    print(f"ratio high TTFT p50 fcfs / priority: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    run_bench(main)
