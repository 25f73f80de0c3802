"""Cache-affinity routing against round robin: encoder token-cache hits and throughput with two
encoder replicas, half of the requests repeating an earlier video.

    PYTHONPATH=. .venv/bin/python bench/bench_routing.py                       # 64 requests, 4 in flight
    PYTHONPATH=. .venv/bin/python bench/bench_routing.py --num-requests 8 --num-frames 4 --clip-size 112

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (built once into --work-dir by
    bench/common.py's build_model), or --model DIR;
  * requests: --num-requests questions, each about one video; --repeat-fraction of them (default
    0.5) repeat a video asked about earlier, each video at most twice, at random distances (see
    `request_sequence` for why), the others are about new synthetic clips
    (bench/common.py's `make_clips`). The same sequence (--seed) goes to both setups;
  * setups, each a fresh stack of plain processes on loopback (caches cold), stopped afterwards:
    two `epd serve encoder` replicas, one prefill, one decode, and `epd serve gateway --encoder
    A,B --routing affinity|round-robin` with the HTTP API;
  * load: the requests over /v1/chat/completions, --concurrency in flight, in sequence order
    (greedy, --max-tokens tokens, ignore_eos);
  * printed: per setup, encoder token-cache hits (each answer's `epd.encoder_cache_hit`, as the
    encoder reported it), requests served by each encoder replica (their LoadService step counts
    moved), req/s over the load, then the ratios affinity / round-robin. Target (#16): >= 1.8x the
    hits, and higher req/s.

Why the two differ: with round robin, a repeated video reaches the replica that holds its tokens
about half the time; with affinity (rendezvous hashing on the video's sha256, the gateway's
default) every repeat does, unless that replica is overloaded (`epd.transport.affinity`).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import bound_ports, build_model, log, make_clips, run_bench, start_server, stop  # noqa: E402

ROUTINGS = ("affinity", "round-robin")


def request_sequence(num_requests: int, repeat_fraction: float, seed: int) -> list[int]:
    """Clip index per request (clips numbered by first appearance): `repeat_fraction` of the
    requests repeat an earlier clip, each repeated clip exactly once, at a random distance.

    Each clip is asked about at most twice on purpose: under round robin a clip asked about a
    third time is a hit on either encoder once both have encoded it, so clips repeated many times
    measure how soon both replicas hold every popular clip (and spend the memory twice), not
    whether a repeat reaches the replica that holds it."""
    if not 0.0 <= repeat_fraction <= 0.5:
        raise SystemExit("--repeat-fraction must be within [0, 0.5]: each clip is repeated at most once")
    rng = random.Random(seed)
    num_repeats = round(num_requests * repeat_fraction)
    num_clips = num_requests - num_repeats
    draws = list(range(num_clips)) + rng.sample(range(num_clips), num_repeats)
    rng.shuffle(draws)
    first_seen: dict[int, int] = {}
    return [first_seen.setdefault(d, len(first_seen)) for d in draws]


def start_stack(model: Path, routing: str, args, log_dir: Path) -> tuple[list[subprocess.Popen], dict]:
    """Two encoders, prefill, decode and the gateway, each `python -m epd.cli.main serve ROLE` on a
    port the kernel picks (`--port 0`, named in its `--ports-file`); the gateway once the stages
    have bound theirs."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads:
        env["OMP_NUM_THREADS"] = args.threads
    procs: list[subprocess.Popen] = []

    def start(name: str, cmd: list[str]) -> Callable[[], dict]:
        """`cmd` started on port 0; a call that waits for the ports it bound."""
        log_path, ports_file = log_dir / f"{routing}-{name}.log", log_dir / f"{routing}-{name}.ports.json"
        ports_file.unlink(missing_ok=True)
        with open(log_path, "w") as out:
            proc = start_server([sys.executable, "-m", "epd.cli.main", *cmd, "--port", "0",
                                 "--ports-file", str(ports_file)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        procs.append(proc)
        return lambda: bound_ports(ports_file, proc, args.timeout_s, log_path)

    try:
        # loopback, one user
        stage = {name: start(name, ["serve", name.split("-")[0], "--model", str(model), "--insecure-no-internal-auth"])
                 for name in ("encoder-1", "encoder-2", "prefill", "decode")}  # fmt: skip
        addr: dict = {name: f"127.0.0.1:{bound()['grpc']}" for name, bound in stage.items()}
        gateway = start("gateway", ["serve", "gateway", "--http-port", "auto",
                                    "--encoder", f"{addr['encoder-1']},{addr['encoder-2']}", "--prefill", addr["prefill"],
                                    "--decode", addr["decode"], "--routing", routing,
                                    "--max-requests-per-client", str(max(8, args.concurrency * 2))])()  # fmt: skip
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return procs, {**addr, "gateway": f"127.0.0.1:{gateway['grpc']}", "http": gateway["http"]}


def wait_ready(procs: list[subprocess.Popen], port: int, timeout_s: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if any(p.poll() is not None for p in procs):
            raise SystemExit("a stack process exited before serving; see the logs in --work-dir")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the stack did not serve within {timeout_s:.0f} s")


def encoder_steps(address: str) -> int:
    import grpc

    from epd.v1 import load_pb2, load_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=10)
    return sum(core.num_steps for core in reply.cores if core.stage != "video_decode")


def ask(port: int, video_url: str, args) -> dict:
    body = {"model": "epd", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "media": {"num_frames": args.num_frames},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url}},
                                                      {"type": "text", "text": "what moves in the video?"}]}]}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=args.timeout_s)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    data = reply.read()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {data[:300]!r}")
    return json.loads(data)


def run(routing: str, model: Path, urls: list[str], seq: list[int], warm_url: str, args) -> dict:
    procs, addr = start_stack(model, routing, args, args.work_dir)
    try:
        wait_ready(procs, addr["http"], args.timeout_s)
        ask(addr["http"], warm_url, args)
        ask(addr["http"], warm_url, args)  # both encoders may have had it: whatever, before counting
        before = {e: encoder_steps(addr[e]) for e in ("encoder-1", "encoder-2")}
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda i: ask(addr["http"], urls[i], args), seq))
        elapsed_s = time.perf_counter() - t0
        after = {e: encoder_steps(addr[e]) for e in ("encoder-1", "encoder-2")}
    finally:
        for p in reversed(procs):
            stop(p)
    hits = sum(bool(a.get("epd", {}).get("encoder_cache_hit")) for a in answers)
    return {"routing": routing, "hits": hits, "requests": len(answers), "elapsed_s": elapsed_s,
            "req_per_s": len(answers) / elapsed_s, "encoder_steps": {e: after[e] - before[e] for e in after}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-routing"))
    p.add_argument("--model", default="", help="model directory (default: build the 27M Qwen2-VL)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--repeat-fraction", type=float, default=0.5, help="share of requests about an earlier video"
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--clip-size", type=int, default=224, help="clip width = height, px")
    p.add_argument("--clip-seconds", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default="", help="OMP_NUM_THREADS of every process (default: inherited)")
    p.add_argument("--routing", default=",".join(ROUTINGS), help="setups to run, comma-separated")
    p.add_argument("--timeout-s", type=float, default=900.0, help="start-up and per-request limit")
    p.add_argument("--output-json", default="")
    args = p.parse_args(argv)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        model = args.work_dir / f"model-27m-{args.clip_size}px"
        if not model.exists():
            log(f"building the 27M Qwen2-VL (frames up to {args.clip_size}x{args.clip_size}) into {model}")
            build_model(model, args.clip_size * args.clip_size)
    seq = request_sequence(args.num_requests, args.repeat_fraction, args.seed)
    num_clips = max(seq) + 1
    log(
        f"{args.num_requests} requests over {num_clips} clips ({args.num_requests - num_clips} repeats); making clips"
    )
    clips = make_clips(args.work_dir / f"clips-{args.clip_size}px-{args.clip_seconds:g}s", num_clips + 1,
                       args.clip_size, args.clip_seconds)  # fmt: skip
    urls = ["data:video/mp4;base64," + base64.b64encode(c.read_bytes()).decode() for c in clips]
    results = []
    for routing in args.routing.split(","):
        log(f"{routing}: starting 2 encoders, prefill, decode and the gateway")
        results.append(run(routing, model, urls[:-1], seq, urls[-1], args))
        r = results[-1]
        log(f"{routing}: {r['hits']} hits of {r['requests']}, {r['req_per_s']:.2f} req/s")

    print(f"\n{args.num_requests} requests ({args.num_requests - num_clips} repeats of earlier videos), "
          f"{args.concurrency} in flight, {args.num_frames} frames at {args.clip_size}px, 2 encoder replicas; "
          f"model {model}")  # fmt: skip
    print(f"{'routing':<12} {'encoder cache hits':>18} {'req/s':>7} {'encoder-1 / encoder-2 steps':>28}")
    for r in results:
        steps = r["encoder_steps"]
        print(f"{r['routing']:<12} {r['hits']:>18} {r['req_per_s']:>7.2f} "
              f"{steps['encoder-1']:>13} / {steps['encoder-2']:<12}")  # fmt: skip
    by = {r["routing"]: r for r in results}
    if set(ROUTINGS) <= set(by):
        a, rr = by["affinity"], by["round-robin"]
        # round robin may hit nothing at all: its ratio then has no number to print
        hits = f"{a['hits'] / rr['hits']:.2f}x" if rr["hits"] else f"{a['hits']} against none"
        print(f"affinity / round-robin: hits {hits}, req/s {a['req_per_s'] / rr['req_per_s']:.2f}x "
              f"(target: >= 1.8x hits, > 1x req/s)")  # fmt: skip
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args) | {"work_dir": str(args.work_dir)},
                                                      "sequence": seq, "results": results}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    run_bench(main)
