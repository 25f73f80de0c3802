"""What large uploads do to everyone else's stream: the longest gap between one answer's streamed
chunks while other clients post large `data:` URLs to the same gateway, against the same answer
with no uploads, in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_upload_stall.py                   # 3 uploads of 64 MiB
    PYTHONPATH=. .venv/bin/python bench/bench_upload_stall.py --upload-mib 32 --uploads 4

What it does:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (built once into --work-dir), or
    --model DIR; one fresh `epd serve` stack on loopback (the gateway its own process), stopped
    afterwards;
  * the measured answer: one streamed chat completion over the OpenAI API about a small clip,
    `--max-tokens` tokens with ignore_eos, its chunks timed as they arrive;
  * phases: "quiet" (the answer alone), then "uploads" (the same answer while --uploads requests,
    one after another, each post a --upload-mib MiB `data:` URL of random bytes; the encoder
    refuses them as not a video, so what they cost is the gateway's: reading, parsing, base64
    decoding and hashing the body);
  * printed: per phase the chunk count, the median and the longest gap between chunks, and the
    ratio uploads / quiet of the longest gap. Whatever blocks the gateway's event loop (a body
    parsed or decoded on it) shows as a long gap in the other answer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import build_model, epd_port_flags, log, make_clips, run_bench, start_server, stop  # noqa: E402
from bench.sse import async_stream_chunks  # noqa: E402


def start_stack(model: Path, log_path: Path) -> tuple[subprocess.Popen, int]:
    ports_file = log_path.with_suffix(".ports.json")
    flags = epd_port_flags(ports_file)
    env = {k: v for k, v in os.environ.items() if k not in ("EPD_API_KEY", "EPD_INTERNAL_SECRET")}
    env["PYTHONPATH"] = str(REPO)
    with open(log_path, "w") as err:
        proc = start_server([sys.executable, "-m", "epd.cli.main", "serve", "--model", str(model), *flags],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)  # fmt: skip
    assert proc.stdout is not None
    if "stack ready" not in proc.stdout.readline():
        stop(proc)
        raise SystemExit(f"the stack did not start:\n{log_path.read_text()[-2000:]}")
    return proc, json.loads(ports_file.read_text())["http"]  # written before the ready line


def _video_message(data: bytes, text: str) -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


async def streamed_chunk_times(session: aiohttp.ClientSession, clip: bytes, max_tokens: int) -> list[float]:
    body = {"model": "epd", "messages": _video_message(clip, "what happens in this video?"), "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "media": {"num_frames": 4}}  # fmt: skip
    times = []
    async with session.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for chunk in async_stream_chunks(resp.content.iter_any()):
            if any("content" in (choice.get("delta") or {}) for choice in chunk.get("choices") or []):
                times.append(time.perf_counter())
    return times


async def upload(session: aiohttp.ClientSession, body: bytes, count: int, start_after_s: float) -> list[int]:
    await asyncio.sleep(start_after_s)  # the answer is streaming by then
    statuses = []
    for _ in range(count):
        async with session.post(
            "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            await r.read()
            statuses.append(r.status)
    return statuses


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


async def measure(port: int, clip: bytes, big: bytes, args) -> dict[str, list[float]]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", timeout=timeout) as session:
        await streamed_chunk_times(session, clip, 8)  # warm-up: the clip's tokens cached, threads up
        quiet = await streamed_chunk_times(session, clip, args.max_tokens)
        loaded, statuses = await asyncio.gather(streamed_chunk_times(session, clip, args.max_tokens),
                                                upload(session, big, args.uploads, 0.5))  # fmt: skip
    log(f"upload answers: {statuses}")
    return {"quiet": gaps_ms(quiet), "uploads": gaps_ms(loaded)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upload-mib", type=int, default=64, help="size of each uploaded body's media, MiB")
    ap.add_argument("--uploads", type=int, default=3, help="uploads posted one after another")
    ap.add_argument("--max-tokens", type=int, default=400, help="tokens of the measured answer")
    ap.add_argument("--model", default="", help="a Qwen2-VL directory (default: bench_pruning's 27M model)")
    ap.add_argument("--work-dir", default="/tmp/epd-bench-upload-stall", help="model, clips, logs")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else work / "model-27m"
    if not args.model and not (model / "config.json").exists():
        log(f"building the 27M model in {model}")
        build_model(model)
    clip = make_clips(work / "clips", 1, 224, 4.0)[0].read_bytes()
    big = json.dumps({"model": "epd", "max_tokens": 4,
                      "messages": _video_message(os.urandom(args.upload_mib << 20), "q")}).encode()  # fmt: skip
    proc, port = start_stack(model, work / "stack.log")
    try:
        gaps = asyncio.run(measure(port, clip, big, args))
    finally:
        stop(proc)
    for phase, values in gaps.items():
        log(
            f"{phase}: {len(values) + 1} chunks, gap median {statistics.median(values):.1f} ms, "
            f"longest {max(values):.0f} ms"
        )
    log(f"longest gap, uploads / quiet: x{max(gaps['uploads']) / max(gaps['quiet']):.1f}")
    return 0


if __name__ == "__main__":
    run_bench(main)
