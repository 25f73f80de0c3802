"""What TLS costs: the same stack with and without it, through the SDK (gRPC front door).

    PYTHONPATH=. .venv/bin/python bench/bench_tls.py                  # 16 requests at 1 and 8 in flight
    PYTHONPATH=. .venv/bin/python bench/bench_tls.py --num-requests 8 --concurrency 1

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (built once into --work-dir), or
    --model DIR; clips: synthetic 224x224 clips (bench/common.py's `make_clips`);
  * setups, each a fresh `epd serve` (the stack on loopback; caches cold), stopped afterwards:
    "plain" (the stack's internal secret, no TLS) and "tls" (`--tls-cert --tls-key --tls-ca`: every
    port TLS, the stages mTLS, certificates made here by `trustme`, a dev dependency);
  * load: for each --concurrency level, --num-requests questions about different clips through
    `EpdClient` (the tls setup's client verifies the gateway with the CA), greedy, --max-tokens
    tokens; every level of a setup gets clips that setup has not seen;
  * printed: per setup and level, req/s, TTFT p50 and end-to-end p50 (client side), then the
    ratios tls / plain. TLS adds a handshake per channel (each stage channel is opened once and
    kept) and encryption of every message (media chunks, embeddings and KV caches between stages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import build_model, log, make_clips, run_bench, start_server, stop  # noqa: E402
from epd.client import EpdClient, TokenDelta  # noqa: E402

QUESTION = "what happens in this video?"


def make_certs(directory: Path) -> dict[str, str]:
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    paths = {"ca": directory / "ca.pem", "cert": directory / "service.pem", "key": directory / "service.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    leaf.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    for blob in leaf.cert_chain_pems[1:]:
        blob.write_to_path(str(paths["cert"]), append=True)
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    return {k: str(v) for k, v in paths.items()}


def start_stack(model: Path, tls: dict[str, str] | None, log_path: Path) -> tuple[subprocess.Popen, str]:
    ports_file = log_path.with_suffix(".ports.json")
    ports_file.unlink(missing_ok=True)
    flags = [
        *(f"--{name}-port=0" for name in ("gateway", "encoder", "prefill", "decode")),
        f"--ports-file={ports_file}",
    ]
    tls_flags = ["--tls-cert", tls["cert"], "--tls-key", tls["key"], "--tls-ca", tls["ca"]] if tls else []
    env = {k: v for k, v in os.environ.items() if k not in ("EPD_API_KEY", "EPD_INTERNAL_SECRET")}
    env["PYTHONPATH"] = str(REPO)
    with open(log_path, "w") as err:
        proc = start_server(
            [
                sys.executable,
                "-m",
                "epd.cli.main",
                "serve",
                "--model",
                str(model),
                "--http-port",
                "0",
                *flags,
                *tls_flags,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "stack ready" not in line:
        stop(proc)
        raise SystemExit(f"the stack did not start:\n{log_path.read_text()[-2000:]}")
    return proc, f"127.0.0.1:{json.loads(ports_file.read_text())['grpc']}"  # written before the ready line


def one(client: EpdClient, clip: Path, args) -> tuple[float, float]:
    """(TTFT, end to end) in seconds of one streamed answer."""
    t0 = time.perf_counter()
    ttft = None
    for event in client.stream(clip, QUESTION, num_frames=args.num_frames, max_new_tokens=args.max_tokens):
        if ttft is None and isinstance(event, TokenDelta):
            ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0


def run_setup(
    name: str, model: Path, clips: list[list[Path]], tls: dict[str, str] | None, args
) -> list[dict]:
    proc, gateway = start_stack(model, tls, args.work / f"tls-bench-{name}.log")
    out = []
    try:
        client_tls = {"root_certificates_path": tls["ca"]} if tls else {}
        with EpdClient(gateway, timeout_s=600, **client_tls) as client:
            one(client, clips[-1][0], args)  # warm-up: channels open, handshakes done
            for c, level_clips in zip(args.concurrency, clips, strict=False):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=c) as pool:
                    results = list(pool.map(lambda clip: one(client, clip, args), level_clips))
                duration = time.perf_counter() - t0
                row = {
                    "setup": name,
                    "concurrency": c,
                    "req_s": len(results) / duration,
                    "ttft_ms": statistics.median(r[0] for r in results) * 1e3,
                    "e2e_ms": statistics.median(r[1] for r in results) * 1e3,
                }
                log(
                    f"{name}: {c} in flight: {row['req_s']:.2f} req/s, TTFT p50 {row['ttft_ms']:.0f} ms, "
                    f"end to end p50 {row['e2e_ms']:.0f} ms"
                )
                out.append(row)
    finally:
        stop(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=16, help="requests at each level")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="", help="a Qwen2-VL directory (default: bench_pruning's 27M model)")
    ap.add_argument("--work-dir", default="/tmp/epd-bench-tls", help="model, clips, logs")
    args = ap.parse_args(argv)
    args.work = Path(args.work_dir)
    args.work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else args.work / "model-27m"
    if not args.model and not (model / "config.json").exists():
        log(f"building the 27M model in {model}")
        build_model(model)
    per_level = args.num_requests
    # Each level of a setup gets clips it has not seen (the token cache would answer repeats),
    # the warm-up one of its own; both setups get the same clips (each a fresh stack).
    clips = make_clips(args.work / "clips", per_level * len(args.concurrency) + 1, 224, 4.0)
    levels = [clips[i * per_level : (i + 1) * per_level] for i in range(len(args.concurrency))] + [clips[-1:]]
    with tempfile.TemporaryDirectory(prefix="epd-tls-bench-") as d:
        certs = make_certs(Path(d))
        rows = run_setup("plain", model, levels, None, args) + run_setup("tls", model, levels, certs, args)
    print(
        f"\n# the stack with and without TLS: {args.num_requests} requests a level, {args.num_frames} frames, "
        f"{args.max_tokens} tokens; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
    )
    print(
        "| in flight | plain req/s | tls req/s | ratio | plain TTFT p50 ms | tls TTFT p50 ms | ratio "
        "| plain end to end p50 ms | tls end to end p50 ms | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        p = next(r for r in rows if r["setup"] == "plain" and r["concurrency"] == c)
        t = next(r for r in rows if r["setup"] == "tls" and r["concurrency"] == c)
        print(
            f"| {c} | {p['req_s']:.2f} | {t['req_s']:.2f} | {t['req_s'] / p['req_s']:.2f}x | {p['ttft_ms']:.0f} "
            f"| {t['ttft_ms']:.0f} | {t['ttft_ms'] / p['ttft_ms']:.2f}x | {p['e2e_ms']:.0f} | {t['e2e_ms']:.0f} "
            f"| {t['e2e_ms'] / p['e2e_ms']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    run_bench(main)
