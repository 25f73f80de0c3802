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
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from epd.bench.openai_load import (
    OpenAITarget,
    completion_bodies,
    openai_bodies,
    rendered_chat_prompts,
    run_openai,
)
from epd.bench.serve_baselines import run_embedded_baseline, run_hf_baseline
from epd.bench.serve_report import ratio_table, sweep_table, write_plot
from epd.bench.serve_requests import DEFAULT_QUESTIONS, RequestResult, summarize
from epd.cmdline.flexible import add_config_flag, parse_flexibly
from epd.cmdline.keyword_help import add_keyword_help
from epd.cmdline.secret_flags import hide_secrets_from_ps
from epd.resources import sample_video


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


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="epd bench serve", description=__doc__.split("\n")[0])
    server = p.add_argument_group("server (the front door measured)")
    door = server.add_mutually_exclusive_group(required=True)
    door.add_argument("--endpoint", default="", help="HOST:PORT of the stack's gateway (gRPC)")
    door.add_argument(
        "--openai",
        default="",
        metavar="BASE_URL",
        help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000 (streaming "
        "/v1/chat/completions)",
    )
    server.add_argument(
        "--openai-dialect",
        choices=["epd", "transformers"],
        default="epd",
        help="with --openai: how frames and ignore_eos are sent (transformers = `transformers serve`)",
    )
    server.add_argument(
        "--media-as",
        choices=["data", "path", "file-url"],
        default="data",
        help="with --openai: media as data: URLs, local paths or file:// URLs",
    )
    server.add_argument(
        "--openai-model", default="", help="with --openai: the body's `model` (default: left out)"
    )
    server.add_argument("--api-key", default="", help="with --openai: sent as 'Authorization: Bearer KEY'")
    server.add_argument("--timeout-s", type=float, default=600.0)
    load = p.add_argument_group("load (the requests and how they are sent)")
    load.add_argument("--videos", nargs="+", default=[str(sample_video())])
    load.add_argument("--questions", nargs="*", default=[])
    load.add_argument("--num-requests", type=int, default=16, help="requests at each concurrency level")
    load.add_argument("--request-rate", type=float, default=0.0, help="requests/s (Poisson); 0 = all at once")
    load.add_argument(
        "--concurrency",
        type=parse_levels,
        default=[1],
        help="max requests in flight (0 = unlimited); a comma list (1,4,16,32) runs a sweep",
    )
    load.add_argument("--num-frames", type=int, default=8)
    load.add_argument("--max-new-tokens", type=int, default=16)
    load.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens")
    load.add_argument("--seed", type=int, default=0)
    goodput = p.add_argument_group("goodput (requests/s that met both objectives)")
    goodput.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    goodput.add_argument("--tpot-slo-ms", type=float, default=200.0)
    compared = p.add_argument_group("comparisons (baselines and other series in the same run)")
    compared.add_argument("--model", default="default", help="the model the stack serves (for the baselines)")
    compared.add_argument("--no-baselines", action="store_true")
    compared.add_argument("--threads", type=int, default=1, help="torch threads of the baselines")
    compared.add_argument(
        "--with-text-only",
        action="store_true",
        help="also run each level's requests without their media (the questions alone) and print the ratios",
    )
    compared.add_argument(
        "--with-completions",
        action="store_true",
        help="with --openai: also run each level's questions as text-only chat requests and as POST "
        "/v1/completions of the same rendered prompt, and print the ratios completions / chat",
    )
    output = p.add_argument_group("output")
    output.add_argument("--output-json", default="", help="write all results here")
    output.add_argument(
        "--plot",
        default="",
        metavar="FILE.png",
        help="write throughput, TTFT and TPOT against concurrency here (needs matplotlib)",
    )
    add_keyword_help(p)  # vLLM's --help=KEYWORD and --config FILE.yaml, as every `epd` command
    add_config_flag(p)
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


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = parse_flexibly(build_parser(), argv)  # --config FILE.yaml, --flag_name: as `epd bench serve`
    if argv is None:  # run as a module: its own command line (`epd bench serve`'s is hidden by epd)
        hide_secrets_from_ps("python -m epd.bench.serve")
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
