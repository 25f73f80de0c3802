"""What a `POST /tokenize` costs: its latency against `GET /v1/models` in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_tokenize.py --openai http://127.0.0.1:8000
    PYTHONPATH=. .venv/bin/python bench/bench_tokenize.py --openai http://127.0.0.1:8000 --num-calls 200 --concurrency 1,8

Against a running epd server's HTTP API (`epd serve`, or `epd serve gateway --http-port`). Three
routes, each called --num-calls times at each --concurrency level (calls in flight):
  models      GET /v1/models: answered by the gateway alone (the model id and max_model_len it
              learnt at start-up), no prefill work: the baseline (HTTP, admission, JSON);
  tokenize    POST /tokenize {"prompt": ...}: the gateway reads the body and calls prefill's
              Tokenize (the stack: a gRPC hop to the least loaded replica), which runs the tokenizer;
  tokenize-chat  POST /tokenize {"messages": [...]}: the same with the chat template rendered first.
The calls of a level run in --rounds rounds, each route's share of a round one after the other, so
that a machine whose load drifts moves every route alike. Printed per level and route: p50, p99
and mean latency in ms and the p50 ratio to /v1/models; a call that fails (not 200, or a
/tokenize answer without tokens) is counted and makes the exit status 1. With --cpu-pid
NAME=PID (repeatable; e.g. the stack's gateway and prefill processes, on this machine), also each
process's CPU time (user + system, /proc/PID/stat) per call of each route: the CPU it used while
that route's calls ran, over their number (what else it does meanwhile, e.g. health checks, counts
too: read it against the models row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epd.cmdline.secret_flags import hide_secrets_from_ps

DEFAULT_PROMPT = (
    "You are looking at a short video of coloured shapes moving on a plain background. "
    "Describe which shapes appear, in which order, where each one moves and what happens at the end."
)


@dataclass
class RouteTimes:
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_ms: dict[str, float] = field(default_factory=dict)
    """Per --cpu-pid name: the process's CPU time while this route's calls ran."""

    def stats(self) -> dict[str, float]:
        arr = np.asarray(self.latencies_ms or [0.0], dtype=np.float64)
        return {
            "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99)),
            "mean": float(arr.mean()),
        }


def routes(prompt: str, model: str) -> dict[str, tuple[str, str, bytes | None]]:
    """name -> (method, path, body)."""
    named = {"model": model} if model else {}
    chat = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    return {
        "models": ("GET", "/v1/models", None),
        "tokenize": ("POST", "/tokenize", json.dumps({"prompt": prompt, **named}).encode()),
        "tokenize-chat": ("POST", "/tokenize", json.dumps({"messages": chat, **named}).encode()),
    }


async def call_many(session, base_url: str, route: tuple[str, str, bytes | None], num_calls: int,
                    concurrency: int, headers: dict[str, str], out: RouteTimes) -> None:  # fmt: skip
    method, path, body = route
    semaphore = asyncio.Semaphore(max(1, concurrency))

    async def one() -> None:
        async with semaphore:
            t0 = time.perf_counter()
            try:
                async with session.request(method, base_url + path, data=body, headers=headers) as resp:
                    payload = await resp.read()
                    ms = (time.perf_counter() - t0) * 1e3
                    if resp.status != 200:
                        out.errors.append(f"{path}: HTTP {resp.status}: {payload[:200]!r}")
                        return
                    if path == "/tokenize" and not json.loads(payload).get("tokens"):
                        out.errors.append(f"{path}: no tokens in {payload[:200]!r}")
                        return
                    out.latencies_ms.append(ms)
            except Exception as exc:  # noqa: BLE001 - recorded per call
                out.errors.append(f"{path}: {type(exc).__name__}: {exc}"[:200])

    await asyncio.gather(*(one() for _ in range(num_calls)))


def cpu_ms(pid: int) -> float:
    """User + system CPU time of `pid` so far (/proc/PID/stat's utime and stime, clock ticks)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


async def run(args) -> dict[int, dict[str, RouteTimes]]:
    import aiohttp

    base_url = args.openai.rstrip("/").removesuffix("/v1")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    table = routes(args.prompt, args.model)
    results: dict[int, dict[str, RouteTimes]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=args.timeout_s)) as session:  # fmt: skip
        warm = RouteTimes()  # connections opened, prefill's tokenizer loaded: not measured
        for route in table.values():
            await call_many(session, base_url, route, 4, 1, headers, warm)
        if warm.errors:
            raise SystemExit(f"bench_tokenize: the warm-up failed: {warm.errors[0]}")
        for c in args.concurrency:
            results[c] = {name: RouteTimes() for name in table}
            per_round = [
                args.num_calls // args.rounds + (i < args.num_calls % args.rounds) for i in range(args.rounds)
            ]
            for n in per_round:
                for name, route in table.items():
                    times = results[c][name]
                    before = {who: cpu_ms(pid) for who, pid in args.cpu_pid}
                    await call_many(session, base_url, route, n, c, headers, times)
                    for who, pid in args.cpu_pid:
                        times.cpu_ms[who] = times.cpu_ms.get(who, 0.0) + cpu_ms(pid) - before[who]
    return results


def report(results: dict[int, dict[str, RouteTimes]], num_calls: int, cpu_names: list[str]) -> list[str]:
    cpu_head = "".join(f" {who} CPU ms/call |" for who in cpu_names)
    lines = ["| in flight | route | ok | p50 ms | p99 ms | mean ms | p50 / models |" + cpu_head,
             "|---|---|---|---|---|---|---|" + "---|" * len(cpu_names)]  # fmt: skip
    for c, by_route in results.items():
        base = by_route["models"].stats()["p50"]
        for name, times in by_route.items():
            s = times.stats()
            cpu = "".join(f" {times.cpu_ms.get(who, 0.0) / num_calls:.2f} |" for who in cpu_names)
            lines.append(f"| {c} | {name} | {len(times.latencies_ms)}/{num_calls} | {s['p50']:.2f} | {s['p99']:.2f} | "
                         f"{s['mean']:.2f} | {s['p50'] / max(base, 1e-9):.2f}x |{cpu}")  # fmt: skip
    return lines


def parse_pid(text: str) -> tuple[str, int]:
    name, _, pid = text.partition("=")
    if not name or not pid.isdigit() or not Path(f"/proc/{pid}/stat").exists():
        raise argparse.ArgumentTypeError(
            f"--cpu-pid takes NAME=PID of a running process on this machine, got {text!r}"
        )
    return name, int(pid)


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency takes integers >= 1 separated by commas, got {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(
            f"--concurrency takes integers >= 1 separated by commas, got {text!r}"
        )
    return levels


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--openai",
        required=True,
        metavar="BASE_URL",
        help="the server's HTTP API (as epd bench serve --openai), e.g. http://127.0.0.1:8000",
    )
    p.add_argument("--num-calls", type=int, default=200, help="calls of each route at each level")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 8], help="calls in flight, a comma list")
    p.add_argument(
        "--rounds", type=int, default=4, help="rounds a level's calls are split into (routes alternate)"
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the text /tokenize is sent")
    p.add_argument("--model", default="", help="the bodies' `model` (default: left out)")
    p.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--cpu-pid",
        type=parse_pid,
        action="append",
        default=[],
        metavar="NAME=PID",
        help="also report this process's CPU time per call of each route (repeatable)",
    )
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--output-json", default="", help="also write every latency here")
    args = p.parse_args(argv)
    if argv is None:  # its own command line: an --api-key must not show in `ps`
        hide_secrets_from_ps("python bench/bench_tokenize.py")
    if args.num_calls < 1 or not 1 <= args.rounds <= args.num_calls:
        p.error("--num-calls must be >= 1 and --rounds between 1 and --num-calls")
    results = asyncio.run(run(args))
    print(f"\n/tokenize against /v1/models at {args.openai}: {args.num_calls} calls per route and level, "
          f"{args.rounds} rounds; prompt of {len(args.prompt)} characters")  # fmt: skip
    print("\n".join(report(results, args.num_calls, [who for who, _ in args.cpu_pid])))
    errors = sorted({e for by_route in results.values() for t in by_route.values() for e in t.errors})
    for e in errors:
        print(f"  error: {e}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {str(c): {name: vars(t) for name, t in by_route.items()} for c, by_route in results.items()}, indent=1))  # fmt: skip
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
