"""`epd bench serve`: latency and throughput of a running stack, against baselines in the same run.

    epd bench serve --endpoint 127.0.0.1:50050 --num-requests 16 --concurrency 2 --model DIR
    epd bench serve --endpoint 127.0.0.1:50050 --request-rate 0.5 --num-requests 16 --model DIR
    epd bench serve --endpoint 127.0.0.1:50050 --concurrency 1,4,16,32 --no-baselines --plot sweep.png
    epd bench serve --openai http://127.0.0.1:8000 --concurrency 1,4 --no-baselines
    epd bench serve --endpoint 127.0.0.1:50050 --concurrency 1 --with-text-only --no-baselines
    epd bench serve --openai http://127.0.0.1:8000 --concurrency 1 --with-completions --no-baselines

Like `vllm bench serve`: N requests (questions about the given videos, cycled) sent at a fixed
rate (Poisson arrivals) or a fixed concurrency to the front door, streaming. Per request: TTFT
(time to the first token), TPOT (time per output token after the first), inter-token latencies
and end-to-end latency. Reported: mean, p50, p90, p99 of each; request and output-token
throughput; goodput (requests/s that met both --ttft-slo-ms and --tpot-slo-ms).

--with-text-only runs, at each level, the same requests again without their media (the questions
alone: no encoder call) against the same server, and prints the ratios text-only / with media.

--with-completions (--openai, an epd or vLLM server) runs, at each level, the questions alone as
text-only chat requests and as legacy `POST /v1/completions` requests whose raw prompt is the
chat request's prompt as the server renders it (/tokenize then /detokenize: the same tokens, so
the same prompt length, no chat template applied by the server), and prints the ratios
completions / chat with each series' prompt tokens.

--concurrency takes a comma list: the same N requests are run at each level in turn (a sweep),
one table row per level (req/s, output tok/s, TTFT p50/p99, TPOT p50/p99, errors), and
--plot FILE.png draws throughput, TTFT and TPOT against concurrency (needs matplotlib, the
`bench` extra). The front door is the gateway's gRPC API (--endpoint) or any OpenAI-compatible
/v1/chat/completions (--openai BASE_URL, streaming SSE; --openai-dialect transformers for
Hugging Face's `transformers serve`, which takes frames in `chat_template_kwargs` and media as
file paths: --media-as path).

In the same run, on the same inputs and model (--model, unless --no-baselines):
  hf        the monolithic Hugging Face pipeline: sequential frame decoding, the processor, and
            `generate()` on the unsplit model, one request at a time;
  embedded  epd's in-process pipeline (one process, no gRPC), one request at a time.
Ratios of the stack to each baseline are printed, and everything is written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from epd.resources import sample_video

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


def _inputs(args) -> list[tuple[bytes | None, str]]:
    videos = [Path(v).read_bytes() for v in args.videos]
    questions = args.questions or DEFAULT_QUESTIONS
    return [(videos[i % len(videos)], questions[i % len(questions)]) for i in range(args.num_requests)]


def text_only(inputs: list[tuple[bytes | None, str]]) -> list[tuple[bytes | None, str]]:
    """The same requests without their media: each question alone (a text-only conversation)."""
    return [(None, question) for _, question in inputs]


def _options(args) -> dict:
    return {
        "num_frames": args.num_frames,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
    }


def parse_levels(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; one number is one level; 0 = unlimited (all at once)."""
    try:
        levels = [int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--concurrency takes integers separated by commas, got {text!r}"
        ) from None
    if not levels or any(c < 0 for c in levels):
        raise argparse.ArgumentTypeError(
            f"--concurrency takes integers >= 0 separated by commas, got {text!r}"
        )
    return levels


async def run_stack(
    args, inputs, progress, concurrency: int | None = None
) -> tuple[list[RequestResult], float]:
    from epd.client import AskResult, AsyncEpdClient, TokenDelta

    results: list[RequestResult] = []
    rng = random.Random(args.seed)
    limit = args.concurrency[0] if concurrency is None else concurrency
    semaphore = asyncio.Semaphore(limit if limit > 0 else len(inputs))

    async def one(client, data, question):
        async with semaphore:
            t0 = time.perf_counter()
            last = t0
            r = RequestResult(ok=False)
            try:
                async for item in client.stream(data, question, **_options(args)):
                    if isinstance(item, AskResult):
                        r.server_timings = {
                            k: v for k, v in asdict(item.timings_ms).items() if k != "extra_ms"
                        }
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


@dataclass(frozen=True)
class OpenAITarget:
    """An OpenAI-compatible /v1/chat/completions endpoint and how to talk to it."""

    base_url: str
    """e.g. http://127.0.0.1:8000 (with or without a trailing /v1)."""
    dialect: str = "epd"
    """'epd': frames in the `media` object, `ignore_eos` sent when asked; 'transformers'
    (`transformers serve`): frames in `chat_template_kwargs`, no `ignore_eos` (it answers 422:
    force the length with `min_new_tokens` in the served model's generation_config.json)."""
    media_as: str = "data"
    """How the media travel: 'data' (a data: URL; epd's default), 'path' (a local file path, what
    `transformers serve` takes for video) or 'file-url' (file:///...)."""
    model: str = ""
    """The body's `model` ('' = leave it out: the server's only/forced model)."""
    api_key: str = ""

    @property
    def url(self) -> str:
        return self.v1 + "/chat/completions"

    @property
    def completions_url(self) -> str:
        return self.v1 + "/completions"

    @property
    def v1(self) -> str:
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    @property
    def root(self) -> str:
        """The server's root, where vLLM's /tokenize and /detokenize are (not under /v1)."""
        return self.v1.removesuffix("/v1")


_MIME = {
    ".mp4": "video/mp4",
    ".mkv": "video/x-matroska",
    ".webm": "video/webm",
    ".mov": "video/quicktime",
    ".avi": "video/x-msvideo",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
}


def media_url(path: str | Path, media_as: str) -> tuple[str, str]:
    """(url, content part type) of one media file: 'video_url', or 'image_url' for stills."""
    p = Path(path).resolve()
    mime = _MIME.get(p.suffix.lower(), "video/mp4")
    kind = "image_url" if mime.startswith("image/") else "video_url"
    if media_as == "data":
        return f"data:{mime};base64," + base64.b64encode(p.read_bytes()).decode(), kind
    if media_as == "file-url":
        return p.as_uri(), kind
    if media_as == "path":
        return str(p), kind
    raise ValueError(f"media_as must be data, path or file-url, got {media_as!r}")


def openai_bodies(
    target: OpenAITarget,
    videos: list[str],
    questions: list[str],
    num_requests: int,
    num_frames: int,
    max_new_tokens: int,
    ignore_eos: bool,
    with_media: bool = True,
) -> list[bytes]:
    """One streaming chat-completions body per request (videos and questions cycled), greedy;
    `with_media` False: the questions alone (no media part)."""
    if target.dialect not in ("epd", "transformers"):
        raise ValueError(f"dialect must be epd or transformers, got {target.dialect!r}")
    if ignore_eos and target.dialect == "transformers":
        raise ValueError(
            "transformers serve answers 422 to ignore_eos: serve a model directory whose "
            "generation_config.json sets min_new_tokens (bench/bench_vs_transformers_serve.py "
            "--ignore-eos does) and leave --ignore-eos off"
        )
    urls = [media_url(v, target.media_as) for v in videos]
    questions = questions or DEFAULT_QUESTIONS
    bodies = []
    for i in range(num_requests):
        url, kind = urls[i % len(urls)]
        media = [{"type": kind, kind: {"url": url}}] if with_media else []
        body = streaming_body(
            target,
            max_new_tokens,
            messages=[
                {"role": "user", "content": [*media, {"type": "text", "text": questions[i % len(questions)]}]}
            ],
        )
        if target.dialect == "epd":
            body["media"] = {"num_frames": num_frames}
            if ignore_eos:
                body["ignore_eos"] = True
        else:
            body["chat_template_kwargs"] = {"num_frames": num_frames}
        bodies.append(json.dumps(body).encode())
    return bodies


def streaming_body(target: OpenAITarget, max_new_tokens: int, **fields) -> dict:
    """A greedy streaming body with its usage at the end, and `fields` (messages or prompt)."""
    body: dict = {
        **fields,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.model:
        body["model"] = target.model
    if target.dialect == "epd":
        body["return_token_ids"] = True  # vLLM's field: each chunk's ids, for per-token gaps
    return body


def chat_message(question: str) -> dict:
    """The user message of a text-only request (openai_bodies' with_media=False)."""
    return {"role": "user", "content": [{"type": "text", "text": question}]}


def rendered_chat_prompts(target: OpenAITarget, questions: list[str], timeout_s: float = 60.0) -> list[str]:
    """Each question's text-only chat prompt as the server renders it (chat template, generation
    prompt): its token ids from POST /tokenize {"messages"}, their text from POST /detokenize
    (special tokens kept). Sent as a raw completions prompt, it is the same tokens again."""
    import urllib.request

    def post(path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if target.api_key:
            headers["Authorization"] = f"Bearer {target.api_key}"
        req = urllib.request.Request(target.root + path, data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    model = {"model": target.model} if target.model else {}
    prompts = []
    for question in questions:
        tokens = post("/tokenize", {"messages": [chat_message(question)], **model})["tokens"]
        prompts.append(post("/detokenize", {"tokens": tokens, **model})["prompt"])
    return prompts


def completion_bodies(
    target: OpenAITarget, prompts: list[str], num_requests: int, max_new_tokens: int, ignore_eos: bool
) -> list[bytes]:
    """One streaming legacy completions body per request (prompts cycled), greedy."""
    bodies = []
    for i in range(num_requests):
        body = streaming_body(target, max_new_tokens, prompt=prompts[i % len(prompts)])
        if ignore_eos:
            body["ignore_eos"] = True
        bodies.append(json.dumps(body).encode())
    return bodies


async def _one_openai(session, target: OpenAITarget, body: bytes, url: str = "") -> RequestResult:
    """One streaming request (to `url`, default chat completions): TTFT and inter-token gaps from
    the chunks that carry text (a chat chunk's delta, a completion chunk's `text`; epd's chunks
    also carry `token_ids`, asked for with `return_token_ids`, counted exactly); the token count from the final usage."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    r = RequestResult(ok=False)
    t0 = last = time.perf_counter()
    counted = 0
    usage_tokens = 0
    try:
        async with session.post(url or target.url, data=body, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("error"):
                    raise RuntimeError(f"error in stream: {str(chunk['error'])[:200]}")
                usage = chunk.get("usage") or {}
                if usage:
                    r.num_prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    usage_tokens = int(usage.get("completion_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    text = (choice.get("delta") or {}).get("content") or choice.get("text")
                    n = len(ids) if ids else (1 if text else 0)
                    if not n:
                        continue
                    now = time.perf_counter()
                    if counted == 0:
                        r.ttft_ms = (now - t0) * 1e3
                    else:
                        r.itl_ms.append((now - last) * 1e3)
                    last = now
                    counted += n
        r.e2e_ms = (time.perf_counter() - t0) * 1e3
        r.num_output_tokens = usage_tokens or counted
        r.ok = counted > 0
        if not r.ok:
            r.error = "the stream carried no tokens"
    except Exception as exc:  # noqa: BLE001 - recorded per request
        r.error = f"{type(exc).__name__}: {exc}"[:200]
    return r


async def run_openai(
    target: OpenAITarget,
    bodies: list[bytes],
    concurrency: int,
    progress=None,
    request_rate: float = 0.0,
    seed: int = 0,
    timeout_s: float = 600.0,
    url: str = "",
) -> tuple[list[RequestResult], float]:
    """The bodies against `target` (`url`, default its chat completions), at most `concurrency` in
    flight (0 = all at once), or arriving at `request_rate` per second (Poisson) when > 0."""
    import aiohttp

    results: list[RequestResult] = []
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency if concurrency > 0 else max(1, len(bodies)))

    async def one(session, body):
        async with semaphore:
            results.append(await _one_openai(session, target, body, url))
            if progress is not None:
                progress.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as session:
        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(one(session, body)))
            if request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def run_hf_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    """processor + generate() on the unsplit model, sequential decoding, one at a time: the
    model and inputs the exactness tests compare against (`epd.model_runtime.hf_reference`)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
    from epd.model_runtime.loader import resolve_model_path
    from epd.video import simple_decoder
    from epd.video.types import SamplingOptions

    torch.set_num_threads(args.threads)
    model, processor = whole_model(resolve_model_path(args.model))

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
        inputs_ = reference_inputs(processor, video, question_message(video, question))
        clock = Clock()
        kwargs = {"min_new_tokens": args.max_new_tokens} if args.ignore_eos else {}
        with torch.inference_mode():
            model.generate(
                **inputs_, do_sample=False, max_new_tokens=args.max_new_tokens, streamer=clock, **kwargs
            )
        times = clock.times
        r = RequestResult(ok=True, e2e_ms=(time.perf_counter() - t0) * 1e3, num_output_tokens=len(times))
        if times:
            r.ttft_ms = (times[0] - t0) * 1e3
            r.itl_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
        results.append(r)
        progress.update(1)
    return results, time.perf_counter() - start


def run_embedded_baseline(args, inputs, progress) -> tuple[list[RequestResult], float]:
    from epd.gateway.ask_types import AskRequest
    from epd.gateway.embedded import build_embedded_pipeline
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
            req = AskRequest(
                question_messages(question),
                MediaInput(data),
                SamplingOptions(num_frames=args.num_frames),
                GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos),
            )
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
    door = p.add_mutually_exclusive_group(required=True)
    door.add_argument("--endpoint", default="", help="HOST:PORT of the stack's gateway (gRPC)")
    door.add_argument(
        "--openai",
        default="",
        metavar="BASE_URL",
        help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000 (streaming "
        "/v1/chat/completions)",
    )
    p.add_argument(
        "--openai-dialect",
        choices=["epd", "transformers"],
        default="epd",
        help="with --openai: how frames and ignore_eos are sent (transformers = `transformers serve`)",
    )
    p.add_argument(
        "--media-as",
        choices=["data", "path", "file-url"],
        default="data",
        help="with --openai: media as data: URLs, local paths or file:// URLs",
    )
    p.add_argument("--openai-model", default="", help="with --openai: the body's `model` (default: left out)")
    p.add_argument("--api-key", default="", help="with --openai: sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default="default", help="the model the stack serves (for the baselines)")
    p.add_argument("--videos", nargs="+", default=[str(sample_video())])
    p.add_argument("--questions", nargs="*", default=[])
    p.add_argument("--num-requests", type=int, default=16, help="requests at each concurrency level")
    p.add_argument("--request-rate", type=float, default=0.0, help="requests/s (Poisson); 0 = all at once")
    p.add_argument(
        "--concurrency",
        type=parse_levels,
        default=[1],
        help="max requests in flight (0 = unlimited); a comma list (1,4,16,32) runs a sweep",
    )
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--tpot-slo-ms", type=float, default=200.0)
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument(
        "--with-text-only",
        action="store_true",
        help="also run each level's requests without their media (the questions alone) and print the ratios",
    )
    p.add_argument(
        "--with-completions",
        action="store_true",
        help="with --openai: also run each level's questions as text-only chat requests and as POST "
        "/v1/completions of the same rendered prompt, and print the ratios completions / chat",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the baselines")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default="", help="write all results here")
    p.add_argument(
        "--plot",
        default="",
        metavar="FILE.png",
        help="write throughput, TTFT and TPOT against concurrency here (needs matplotlib)",
    )
    return p


def _print_table(name: str, s: dict) -> None:
    print(
        f"\n== {name}: {s['num_completed']}/{s['num_requests']} ok in {s['duration_s']:.2f} s; "
        f"{s['request_throughput_rps']:.3f} req/s, {s['output_token_throughput_tps']:.1f} tok/s, "
        f"goodput {s['goodput_rps']:.3f} req/s"
    )
    print("| metric | mean | p50 | p90 | p99 |")
    print("|---|---|---|---|---|")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"| {key} | {v['mean']:.1f} | {v['p50']:.1f} | {v['p90']:.1f} | {v['p99']:.1f} |")


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


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    levels: list[int] = args.concurrency
    target = None
    if args.openai:
        target = OpenAITarget(
            args.openai, args.openai_dialect, args.media_as, args.openai_model, args.api_key
        )
        try:
            bodies = openai_bodies(
                target,
                args.videos,
                args.questions,
                args.num_requests,
                args.num_frames,
                args.max_new_tokens,
                args.ignore_eos,
            )
        except ValueError as exc:
            print(f"epd bench serve: {exc}", file=sys.stderr)
            return 2
    if args.with_completions and (target is None or target.dialect != "epd"):
        print("epd bench serve: --with-completions needs --openai with the epd dialect (it posts "
              "/tokenize, /detokenize and /v1/completions)", file=sys.stderr)  # fmt: skip
        return 2
    inputs = _inputs(args)
    door = f"OpenAI API {target.url} ({target.dialect})" if target else f"gRPC {args.endpoint}"
    report: dict = {"config": vars(args), "sweep": []}

    def run_level(c: int, series: str) -> dict:
        """One level of one series: 'media' (the requests as given), 'text' (the questions alone,
        chat) or 'completions' (the questions' rendered chat prompts, raw)."""
        what = {"media": "stack", "text": "stack, text only", "completions": "stack, completions"}[series]
        with tqdm(
            total=len(inputs), desc=f"{what}, {c or 'all'} in flight", unit="req", file=sys.stderr
        ) as bar:
            if target is not None:
                url = target.url
                if series == "media":
                    level_bodies = bodies
                elif series == "text":
                    level_bodies = openai_bodies(
                        target, args.videos, args.questions, args.num_requests, args.num_frames,
                        args.max_new_tokens, args.ignore_eos, with_media=False,
                    )  # fmt: skip
                else:
                    prompts = rendered_chat_prompts(
                        target, args.questions or DEFAULT_QUESTIONS, args.timeout_s
                    )
                    level_bodies = completion_bodies(
                        target, prompts, args.num_requests, args.max_new_tokens, args.ignore_eos
                    )
                    url = target.completions_url
                results, duration = asyncio.run(
                    run_openai(
                        target, level_bodies, c, bar, args.request_rate, args.seed, args.timeout_s, url
                    )
                )
            else:
                level_inputs = inputs if series == "media" else text_only(inputs)
                results, duration = asyncio.run(run_stack(args, level_inputs, bar, c))
        summary = summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms)
        shown = f"OpenAI API {target.completions_url}" if series == "completions" and target else door
        _print_table(f"{what} ({shown}), {c or 'all'} in flight", summary)
        return {"concurrency": c, "summary": summary, "requests": [asdict(r) for r in results]}

    for c in levels:
        report["sweep"].append(run_level(c, "media"))
        if args.with_text_only or args.with_completions:
            report.setdefault("text_only_sweep", []).append(run_level(c, "text"))
        if args.with_completions:
            report.setdefault("completions_sweep", []).append(run_level(c, "completions"))
    # The first level keeps the single-level report's names.
    report["stack"] = report["sweep"][0]["summary"]
    report["stack_requests"] = report["sweep"][0]["requests"]
    print(
        f"\n== concurrency sweep ({door}; {args.num_requests} requests a level, {args.num_frames} frames, "
        f"{args.max_new_tokens} new tokens{', ignore_eos' if args.ignore_eos else ''})"
    )
    print("\n".join(sweep_table(report["sweep"])))
    if args.with_text_only:
        print("\n".join(ratio_table("text only / with media", report["sweep"], report["text_only_sweep"])))
    if args.with_completions:
        print("\n".join(ratio_table("completions / text-only chat", report["text_only_sweep"],
                                     report["completions_sweep"], prompt_tokens=True)))  # fmt: skip
    levels_run = report["sweep"] + report.get("text_only_sweep", []) + report.get("completions_sweep", [])
    errors = sorted({e for lv in levels_run for e in lv["summary"]["errors"]})
    for e in errors:
        print(f"  error: {e}")
    if not args.no_baselines:
        for name, runner in (("hf", run_hf_baseline), ("embedded", run_embedded_baseline)):
            with tqdm(total=len(inputs), desc=name, unit="req", file=sys.stderr) as bar:
                res, dur = runner(args, inputs, bar)
            report[name] = summarize(res, dur, args.ttft_slo_ms, args.tpot_slo_ms)
            _print_table(
                {"hf": "hf baseline (processor + generate)", "embedded": "embedded"}[name], report[name]
            )
        print("\n| ratio (stack vs baseline) | hf | embedded |")
        print("|---|---|---|")
        for level in report["sweep"]:
            s = level["summary"]
            at = f", {level['concurrency'] or 'all'} in flight" if len(levels) > 1 else ""
            print(
                f"| throughput (higher is better){at} | "
                f"{s['request_throughput_rps'] / max(report['hf']['request_throughput_rps'], 1e-9):.2f}x | "
                f"{s['request_throughput_rps'] / max(report['embedded']['request_throughput_rps'], 1e-9):.2f}x |"
            )
            for key in ("ttft_ms", "e2e_ms"):
                print(
                    f"| {key} p50 (lower is better){at} | {s[key]['p50'] / max(report['hf'][key]['p50'], 1e-9):.2f}x | "
                    f"{s[key]['p50'] / max(report['embedded'][key]['p50'], 1e-9):.2f}x |"
                )
    if args.plot:
        write_plot(
            args.plot,
            {"epd" if target is None or target.dialect == "epd" else "server": report["sweep"]},
            title=f"{door}: {args.num_frames} frames, {args.max_new_tokens} tokens",
        )
        print(f"plot: {args.plot}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0 if all(lv["summary"]["num_failed"] == 0 for lv in levels_run) else 1


if __name__ == "__main__":
    sys.exit(main())
