"""`epd bench serve`: latency and throughput of a running stack, against baselines in the same run.

    epd bench serve --endpoint 127.0.0.1:50050 --num-requests 16 --concurrency 2 --model DIR
    epd bench serve --endpoint 127.0.0.1:50050 --request-rate 0.5 --num-requests 16 --model DIR

Like `vllm bench serve`: N requests (questions about the given videos, cycled) sent at a fixed
rate (Poisson arrivals) or a fixed concurrency to the front door, streaming. Per request: TTFT
(time to the first token), TPOT (time per output token after the first), inter-token latencies
and end-to-end latency. Reported: mean, p50, p90, p99 of each; request and output-token
throughput; goodput (requests/s that met both --ttft-slo-ms and --tpot-slo-ms).

In the same run, on the same inputs and model (--model, unless --no-baselines):
  hf        the monolithic Hugging Face pipeline: sequential frame decoding, the processor, and
            `generate()` on the unsplit model, one request at a time;
  embedded  epd's in-process pipeline (one process, no gRPC), one request at a time.
Ratios of the stack to each baseline are printed, and everything is written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from epd.resources import sample_video

DEFAULT_QUESTIONS = ["what colour is the circle?", "how many objects are there in the video?",
                     "which direction does the square move?", "what happens at the end?"]


@dataclass
class RequestResult:
    ok: bool
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str = ""
    server_timings: dict[str, float] = field(default_factory=dict)
    """The stack's own timings of the request, e.g. video_decode_ms, ttft_ms (`AskResult.timings_ms`;
    stack only)."""

    @property
    def tpot_ms(self) -> float:
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.e2e_ms - self.ttft_ms) / (self.num_output_tokens - 1)


def summarize(results: list[RequestResult], duration_s: float, ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    """Aggregate statistics; percentiles over successful requests."""
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        arr = np.asarray(values, dtype=np.float64)
        return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
                "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}

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


def _inputs(args) -> list[tuple[bytes, str]]:
    videos = [Path(v).read_bytes() for v in args.videos]
    questions = args.questions or DEFAULT_QUESTIONS
    return [(videos[i % len(videos)], questions[i % len(questions)]) for i in range(args.num_requests)]


def _options(args) -> dict:
    return {"num_frames": args.num_frames, "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos}


async def run_stack(args, inputs, progress) -> tuple[list[RequestResult], float]:
    from epd.client import AskResult, AsyncEpdClient, TokenDelta

    results: list[RequestResult] = []
    rng = random.Random(args.seed)
    semaphore = asyncio.Semaphore(args.concurrency if args.concurrency > 0 else len(inputs))

    async def one(client, data, question):
        async with semaphore:
            t0 = time.perf_counter()
            last = t0
            r = RequestResult(ok=False)
            try:
                async for item in client.stream(data, question, **_options(args)):
                    if isinstance(item, AskResult):
                        r.server_timings = {k: v for k, v in asdict(item.timings_ms).items() if k != "extra_ms"}
                    if not isinstance(item, TokenDelta):
                        continue
                    now = time.perf_counter()
                    if r.num_output_tokens == 0:
                        r.ttft_ms = (now - t0) * 1e3
                    else:
                        r.itl_ms.append((now - last) * 1e3)
                    last = now
                    r.num_output_tokens += len(item.token_ids)
                r.e2e_ms = (time.perf_counter() - t0) * 1e3
                r.ok = True
            except Exception as exc:  # noqa: BLE001 - recorded per request
                r.error = str(exc)[:200]
            results.append(r)
            progress.update(1)

    async with AsyncEpdClient(args.endpoint, timeout_s=args.timeout_s) as client:
        start = time.perf_counter()
        tasks = []
        for data, question in inputs:
            tasks.append(asyncio.ensure_future(one(client, data, question)))
            if args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def run_hf_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    """processor + generate() on the unsplit model, sequential decoding, one at a time."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from transformers.generation.streamers import BaseStreamer
    from transformers.video_utils import VideoMetadata

    from epd.model_runtime.loader import resolve_model_path
    from epd.video import simple_decoder
    from epd.video.types import SamplingOptions

    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.first = True

        def put(self, value):
            if self.first:  # generate() puts the prompt first
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    results = []
    start = time.perf_counter()
    for data, question in inputs:
        t0 = time.perf_counter()
        video = simple_decoder.decode(data, SamplingOptions(num_frames=args.num_frames))
        kind = "image" if video.is_image else "video"
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if video.is_image:
            inputs_ = processor(text=[text], images=[video.frames[0]], return_tensors="pt")
        else:
            meta = VideoMetadata(total_num_frames=video.num_frames, fps=video.sampled_fps,
                                 frames_indices=list(range(video.num_frames)))
            inputs_ = processor(text=[text], videos=[video.frames], return_tensors="pt",
                                videos_kwargs={"do_sample_frames": False, "cap_pixels_per_frame": False,
                                               "video_metadata": [meta]})
        clock = Clock()
        kwargs = {"min_new_tokens": args.max_new_tokens} if args.ignore_eos else {}
        with torch.inference_mode():
            model.generate(**inputs_, do_sample=False, max_new_tokens=args.max_new_tokens, streamer=clock, **kwargs)
        times = clock.times
        r = RequestResult(ok=True, e2e_ms=(time.perf_counter() - t0) * 1e3, num_output_tokens=len(times))
        if times:
            r.ttft_ms = (times[0] - t0) * 1e3
            r.itl_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        results.append(r)
        progress.update(1)
    return results, time.perf_counter() - start


def run_embedded_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.gateway.pipeline import AskRequest
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput, TokenStep
    from epd.stages.messages import question_messages
    from epd.video.types import SamplingOptions

    pipeline = build_embedded_pipeline(ModelConfig(model=args.model, num_threads=args.threads))

    async def run():
        results = []
        start = time.perf_counter()
        for data, question in inputs:
            req = AskRequest(question_messages(question), MediaInput(data), SamplingOptions(num_frames=args.num_frames),
                             GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos))
            t0 = last = time.perf_counter()
            r = RequestResult(ok=True)
            async for item in pipeline.ask(req):
                if isinstance(item, TokenStep):
                    now = time.perf_counter()
                    if r.num_output_tokens == 0:
                        r.ttft_ms = (now - t0) * 1e3
                    else:
                        r.itl_ms.append((now - last) * 1e3)
                    last = now
                    r.num_output_tokens += len(item.token_ids)
            r.e2e_ms = (time.perf_counter() - t0) * 1e3
            results.append(r)
            progress.update(1)
        return results, time.perf_counter() - start

    return asyncio.run(run())


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="epd bench serve", description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", required=True, help="HOST:PORT of the stack's gateway")
    p.add_argument("--model", default="default", help="the model the stack serves (for the baselines)")
    p.add_argument("--videos", nargs="+", default=[str(sample_video())])
    p.add_argument("--questions", nargs="*", default=[])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=0.0, help="requests/s (Poisson); 0 = all at once")
    p.add_argument("--concurrency", type=int, default=1, help="max requests in flight (0 = unlimited)")
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the baselines")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="", help="write all results here")
    return p


def _print_table(name: str, s: dict) -> None:
    print(f"\n== {name}: {s['num_completed']}/{s['num_requests']} ok in {s['duration_s']:.2f} s; "
          f"{s['request_throughput_rps']:.3f} req/s, {s['output_token_throughput_tps']:.1f} tok/s, "
          f"goodput {s['goodput_rps']:.3f} req/s")
    print("| metric | mean | p50 | p90 | p99 |")
    print("|---|---|---|---|---|")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"| {key} | {v['mean']:.1f} | {v['p50']:.1f} | {v['p90']:.1f} | {v['p99']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    inputs = _inputs(args)
    report: dict = {"config": vars(args)}
    with tqdm(total=len(inputs), desc="stack", unit="req", file=sys.stderr) as bar:
        results, duration = asyncio.run(run_stack(args, inputs, bar))
    report["stack"] = summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms)
    report["stack_requests"] = [asdict(r) for r in results]
    _print_table("stack (disaggregated, gRPC)", report["stack"])
    if not args.no_baselines:
        for name, runner in (("hf", run_hf_baseline), ("embedded", run_embedded_baseline)):
            with tqdm(total=len(inputs), desc=name, unit="req", file=sys.stderr) as bar:
                res, dur = runner(args, inputs, bar)
            report[name] = summarize(res, dur, args.ttft_slo_ms, args.tpot_slo_ms)
            _print_table({"hf": "hf baseline (processor + generate)", "embedded": "embedded"}[name], report[name])
        print("\n| ratio (stack vs baseline) | hf | embedded |")
        print("|---|---|---|")
        for key, label in (("request_throughput_rps", "throughput (higher is better)"),):
            print(f"| {label} | {report['stack'][key] / max(report['hf'][key], 1e-9):.2f}x | "
                  f"{report['stack'][key] / max(report['embedded'][key], 1e-9):.2f}x |")
        for key in ("ttft_ms", "e2e_ms"):
            print(f"| {key} p50 (lower is better) | {report['stack'][key]['p50'] / max(report['hf'][key]['p50'], 1e-9):.2f}x | "
                  f"{report['stack'][key]['p50'] / max(report['embedded'][key]['p50'], 1e-9):.2f}x |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0 if report["stack"]["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
