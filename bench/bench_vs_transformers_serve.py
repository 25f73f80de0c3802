"""epd against Hugging Face `transformers serve`: the same streaming OpenAI-API load at several concurrencies.

    PYTHONPATH=. .venv/bin/python bench/bench_vs_transformers_serve.py                 # 1,4 in flight, 8 requests
    PYTHONPATH=. .venv/bin/python bench/bench_vs_transformers_serve.py --concurrency 1,4,16 \\
        --num-requests 32 --num-clips 32 --num-frames 8 --max-tokens 32 --plot vs.png   # issue #13's first setting
    ... --concurrency 1,16 --num-frames 4 --max-tokens 64 --ignore-eos                  # its second

Needs the `bench` extra (`pip install -e .[bench]`: transformers[serving], matplotlib for --plot),
psutil and torchcodec (`pip install torchcodec`; see "torchcodec" below).

What it does, in one run on one machine:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (randomly initialised; built once
    into --work-dir), or --model DIR;
  * clips: --num-clips different synthetic clips per concurrency level (epd.synth scenes,
    --clip-size square, 8 fps, --clip-seconds long; no clip is used at two levels, so epd's token
    cache never answers a level from an earlier one), each request about one of them (cycled),
    with one of four questions;
  * servers, one after the other, each started fresh as plain processes on free loopback ports:
      epd           `epd serve` (launcher, encoder, prefill, decode, gateway with --http-port), torch
                    threads per service --epd-threads (epd's default, 1);
      transformers  `transformers serve MODEL --device cpu` through bench/transformers_serve_launcher.py
                    (the patch it applies is explained there), torch's default threads unless
                    --peer-threads;
  * per server: wait until one request succeeds (start-up), --warmup more requests, PSS summed over
    the server's process tree (psutil `memory_full_info().pss`) at idle, then N requests at each
    --concurrency level (streaming /v1/chat/completions, greedy, the same bodies in the same order
    for every server; TTFT = first text chunk, TPOT = (end - first) / (tokens - 1) with the server's own
    usage.completion_tokens), the PSS peak sampled every second during the load and the PSS after it,
    settled (`settled`: read every 0.5 s until three reads agree within 1%, at most 5.5 s, so the
    services' idle release, up to 1 s after their last request, has given their free memory back);
  * printed: each server's sweep table, the side-by-side with ratios epd / transformers (req/s and
    output tok/s: higher is better for epd; TTFT and TPOT: lower is better), the memory table, and
    the prompt tokens each server reported (the same input must make the same prompt).

Quirks of stock `transformers serve` 5.23 handled here:
  * Qwen2-VL video without an audio track fails (it loads audio from every video of a model it
    classes as "multimodal"): the launcher makes it treat Qwen2-VL as image/video + text;
  * it rejects `data:` video URLs: it gets absolute file paths (epd gets data: URLs, as clients send);
  * frames: its default is 32 a video; it gets `chat_template_kwargs: {"num_frames": N}`, epd
    `media: {"num_frames": N}`;
  * `ignore_eos` is answered with 422: with --ignore-eos both servers serve a copy of the model
    directory whose generation_config.json sets `min_new_tokens` = --max-tokens, and epd also gets
    its own `ignore_eos: true`;
  * it reads mp4 with torchcodec, which needs FFmpeg's shared libraries; without a system FFmpeg
    the transformers process gets LD_LIBRARY_PATH to a directory of symlinks (libavutil.so.60, ...)
    to the FFmpeg 8 libraries bundled in PyAV's wheel (av.libs), and the run stops with a message
    if torchcodec still cannot decode.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from epd.bench.common import (  # noqa: E402
    bound_ports,
    build_model,
    epd_port_flags,
    log,
    make_clips,
    run_bench,
    start_server,
    stop,
)
from epd.bench.openai_load import OpenAITarget, openai_bodies, run_openai  # noqa: E402
from epd.bench.process_tree import (  # noqa: E402
    MiB,
    PeakPss,
    cpu_by_role,
    memory_lines,
    settled,
    tree_cpu_s,
    tree_memory,
    tree_on_tcmalloc,
    tree_pss,
    tree_pss_alone,
)
from epd.bench.serve import parse_levels  # noqa: E402
from epd.bench.serve_report import sweep_table, write_plot  # noqa: E402
from epd.bench.serve_requests import DEFAULT_QUESTIONS, summarize  # noqa: E402
from epd.bench.vs_transformers_report import cpu_table, memory_table, side_by_side  # noqa: E402
from epd.transport.ports_file import free_port  # noqa: E402

SERVERS = ("epd", "epd-t1", "epd-colocate", "transformers")
"""epd: the four-process stack (`epd serve`, --epd-threads); epd-t1: the same with one torch thread
per model call; epd-colocate: one process (`epd serve --colocate`, --epd-threads)."""


# ---------------------------------------------------------------------------------------------
# inputs


def min_tokens_copy(model_dir: Path, out: Path, min_new_tokens: int) -> Path:
    """A copy of `model_dir` (files symlinked) whose generation_config.json forces the length."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f.resolve())
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config["min_new_tokens"] = min_new_tokens
    (out / "generation_config.json").write_text(json.dumps(config, indent=2))
    return out


def clips_per_level(clips: list[Path], args) -> list[list[Path]]:
    """--num-clips clips for each --concurrency level, none shared between levels (`clips` holds
    `num_clips * levels + 1`; the last is start-up's and warm-up's)."""
    n = args.num_clips
    return [clips[i * n : (i + 1) * n] for i in range(len(args.concurrency))]


def torchcodec_env(work: Path, clip: Path) -> dict[str, str]:
    """Environment additions under which torchcodec decodes `clip` (see the module docstring)."""
    probe = "import sys; from torchcodec.decoders import VideoDecoder; VideoDecoder(sys.argv[1])[0]"

    def works(extra: dict[str, str]) -> bool:
        env = {**os.environ, **extra}
        return (
            subprocess.run([sys.executable, "-c", probe, str(clip)], env=env, capture_output=True).returncode
            == 0
        )

    if works({}):
        return {}
    libs: Path | None = None  # PyAV's wheel's bundled FFmpeg, when PyAV is installed
    try:
        import av
    except ImportError:
        pass
    else:
        libs = Path(av.__file__).resolve().parent.parent / "av.libs"
    if libs is not None:
        shim = work / "ffmpeg-shim"
        shim.mkdir(parents=True, exist_ok=True)
        for lib in sorted(libs.glob("lib*.so*")):
            stem, _, rest = lib.name.partition("-")  # libavutil-5809ad29.so.60.26.102
            if not stem.startswith(("libav", "libsw", "libpostproc")) or ".so." not in rest:
                continue
            link = shim / f"{stem}.so.{rest.split('.so.')[1].split('.')[0]}"
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(lib)
        extra = {
            "LD_LIBRARY_PATH": os.pathsep.join(
                filter(None, [str(shim), str(libs), os.environ.get("LD_LIBRARY_PATH", "")])
            )
        }
        if works(extra):
            return extra
    raise SystemExit(
        "torchcodec cannot decode mp4 here (transformers serve needs it for video): "
        "`pip install torchcodec` and an FFmpeg it supports (4-9) with shared libraries"
    )


# ---------------------------------------------------------------------------------------------
# servers


def server_command(name: str, model: Path, args) -> tuple[list[str], dict[str, str], str | Path]:
    """(command, environment, base URL) of one server on free loopback ports; for epd, its ports
    file instead of the URL (it binds ports the kernel picks and names them there: `bound_ports`)."""
    # The repository first, then the caller's own PYTHONPATH: packages installed with `pip install
    # --target` (transformers[serving] and torchcodec beside a shared venv) reach both servers.
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    if name.startswith("epd"):
        ports_file = args.work / f"{name}.ports.json"
        cmd = [
            sys.executable,
            "-m",
            "epd.cli.main",
            "--log-level",  # INFO: a `request done` line per request with its stage timings, in the log
            args.epd_log_level,
            "serve",
            "--model",
            str(model),
            "--num-threads",
            "1" if name == "epd-t1" else str(args.epd_threads),
            *epd_port_flags(ports_file, stages=name != "epd-colocate"),
            # One load client sends every request: lift the per-client limit above the sweep's top level.
            "--max-requests-per-client",
            str(max(c or args.num_requests for c in args.concurrency) + 1),  # 0 = all at once
            *(["--colocate"] if name == "epd-colocate" else []),
            *args.epd_arg,
        ]
        env.pop("OMP_NUM_THREADS", None)
        threads = "1" if name == "epd-t1" else args.epd_threads
        if threads.isdigit():
            env["OMP_NUM_THREADS"] = threads
        return cmd, env, ports_file
    port = free_port()
    cmd = [
        sys.executable,
        str(REPO / "bench" / "transformers_serve_launcher.py"),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        *args.peer_arg,
    ]
    env.pop("OMP_NUM_THREADS", None)
    if args.peer_threads > 0:
        env["OMP_NUM_THREADS"] = str(args.peer_threads)
    env.update(args.torchcodec_env)
    return cmd, env, f"http://127.0.0.1:{port}"


def wait_ready(
    proc: subprocess.Popen, target: OpenAITarget, body: bytes, timeout_s: float, log_path: Path
) -> float:
    """Seconds until one request succeeds; the server's log tail if it exits or never answers."""
    t0 = time.perf_counter()
    last = ""
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(
                f"the server exited with {proc.returncode} before answering ({last}); log:\n{tail}"
            )
        results, _ = asyncio.run(run_openai(target, [body], 1, timeout_s=timeout_s))
        if results[0].ok:
            return time.perf_counter() - t0
        last = results[0].error
        if "HTTP 4" in last and "HTTP 429" not in last:  # a refused request will not start working
            raise SystemExit(f"the server refused the request: {last}")
        time.sleep(0.5)
    tail = log_path.read_text(errors="replace")[-3000:]
    raise SystemExit(f"no answer within {timeout_s:.0f} s ({last}); log:\n{tail}")


def run_server(name: str, model: Path, clips: list[Path], args) -> dict:
    """Start one server, load it at every level, stop it: its sweep, memory and start-up."""
    dialect = "epd" if name.startswith("epd") else "transformers"
    cmd, env, where = server_command(name, model, args)
    # epd's URL once it has bound its port (`bound_ports`): the bodies do not depend on it
    base_url = where if isinstance(where, str) else ""
    target = OpenAITarget(base_url, dialect=dialect, media_as="data" if name.startswith("epd") else "path")

    def bodies_of(level_clips: list[Path], num_requests: int) -> list[bytes]:
        return openai_bodies(
            target,
            [str(c) for c in level_clips],
            DEFAULT_QUESTIONS,
            num_requests,
            args.num_frames,
            args.max_tokens,
            args.ignore_eos and name.startswith("epd"),
        )

    # Every level gets clips no server has seen, and start-up and warm-up a clip of their own: epd's
    # token cache would otherwise answer a level's videos from memory (a repeated video is a cache
    # hit, which `transformers serve` does not have); the same bodies go to every server.
    per_level = clips_per_level(clips, args)
    warm_bodies = bodies_of(clips[-1:], max(args.warmup, 1))
    log_path = args.work / f"{name}.log"
    log(f"{name}: starting ({' '.join(cmd[:6])} ...; log {log_path})")
    with open(log_path, "w") as log_file:
        proc = start_server(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    started = time.perf_counter()
    try:
        if isinstance(where, Path):  # the stack names its ports once it is ready
            http_port = bound_ports(where, proc, args.timeout_s, log_path)["http"]
            target = dataclasses.replace(target, base_url=f"http://127.0.0.1:{http_port}")
    except BaseException:
        stop(proc)
        raise
    out: dict = {"name": name, "command": cmd, "url": target.url, "sweep": []}
    try:
        # from the launch: the wait for the ports file is part of the start-up
        out["startup_s"] = (time.perf_counter() - started) + wait_ready(
            proc, target, warm_bodies[0], args.timeout_s, log_path
        )
        log(f"{name}: answered after {out['startup_s']:.1f} s; {args.warmup} warm-up request(s)")
        if args.warmup:
            asyncio.run(run_openai(target, warm_bodies[: args.warmup], 1, timeout_s=args.timeout_s))
        time.sleep(2.0)
        out["pss_idle"], out["num_processes"] = tree_pss(proc.pid)
        out["num_on_tcmalloc"] = tree_on_tcmalloc(proc.pid)
        out["memory_idle"] = tree_memory(proc.pid)
        out["pss_alone_idle"] = tree_pss_alone(proc.pid)
        log(f"{name}: idle PSS {out['pss_idle'] / MiB:.0f} MiB over {out['num_processes']} processes")
        log("\n".join(["idle, by process (MiB):", *memory_lines(out["memory_idle"])]))
        with PeakPss(proc.pid) as peak:
            for c, level_clips in zip(args.concurrency, per_level, strict=True):
                t0 = time.perf_counter()
                bodies = bodies_of(level_clips, args.num_requests)
                cpu_before = tree_cpu_s(proc.pid)
                results, duration = asyncio.run(run_openai(target, bodies, c, timeout_s=args.timeout_s))
                cpu = cpu_by_role(cpu_before, tree_cpu_s(proc.pid))
                s = summarize(results, duration, float("inf"), float("inf"))
                prompt = [r.num_prompt_tokens for r in results if r.ok and r.num_prompt_tokens]
                out["sweep"].append(
                    {
                        "concurrency": c,
                        "summary": s,
                        "prompt_tokens": statistics.median(prompt) if prompt else 0,
                        "cpu_s": cpu,
                        "duration_s": duration,
                    }
                )
                log(
                    f"{name}: {c} in flight: {s['num_completed']}/{s['num_requests']} ok in "
                    f"{time.perf_counter() - t0:.1f} s, {s['request_throughput_rps']:.2f} req/s, "
                    f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, TPOT p50 {s['tpot_ms']['p50']:.1f} ms"
                    + (f"; errors: {s['errors'][:2]}" if s["errors"] else "")
                )
        out["pss_peak"], out["memory_peak"] = peak.peak, peak.at_peak
        # once idle and released: read at once, it sat near the peak (the release comes up to 1 s later)
        out["pss_after"], out["pss_after_settled"] = settled(lambda: tree_pss(proc.pid)[0])
        out["memory_after"] = tree_memory(proc.pid)
        out["pss_alone_after"] = tree_pss_alone(proc.pid)
        log(
            f"{name}: PSS after the load, settled {out['pss_after'] / MiB:.0f} MiB "
            f"(peak {out['pss_peak'] / MiB:.0f} MiB)" + ("" if out["pss_after_settled"] else "; still moving")
        )
        for when in ("peak", "after"):
            log("\n".join([f"{when}, by process (MiB):", *memory_lines(out[f"memory_{when}"])]))
        for when in ("idle", "after"):
            if (alone := out[f"pss_alone_{when}"]) is not None:
                parts = ", ".join(f"{k} {v:.0f}" for k, v in alone.items() if k != "total")
                log(f"{name}: PSS {when} as if alone on the machine {alone['total']:.0f} MiB ({parts})")
    finally:
        stop(proc)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--concurrency", type=parse_levels, default=[1, 4], help="comma list of requests in flight"
    )
    ap.add_argument("--num-requests", type=int, default=8, help="requests at each level")
    ap.add_argument(
        "--num-clips",
        type=int,
        default=8,
        help="different clips per concurrency level, cycled over its requests (no clip is "
        "used by two levels, so a token cache never answers a level from an earlier one)",
    )
    ap.add_argument("--num-frames", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every answer --max-tokens long (min_new_tokens in a copy of the model dir; epd: ignore_eos)",
    )
    ap.add_argument("--clip-size", type=int, default=224, help="clip width = height in pixels")
    ap.add_argument("--clip-seconds", type=float, default=4.0)
    ap.add_argument("--model", default="", help="a Qwen2-VL directory (default: bench_pruning's 27M model)")
    ap.add_argument("--servers", default="epd,transformers", help=f"comma list of {', '.join(SERVERS)}")
    ap.add_argument(
        "--epd-threads", default="1", help="torch threads per epd model call (--num-threads: N or auto)"
    )
    ap.add_argument(
        "--peer-threads", type=int, default=0, help="OMP_NUM_THREADS of transformers serve (0 = its default)"
    )
    ap.add_argument("--epd-arg", action="append", default=[], help="extra `epd serve` argument (repeatable)")
    ap.add_argument(
        "--epd-log-level",
        default="WARNING",
        help="epd's --log-level; INFO logs each request's stage timings (`request done`) in "
        "<work-dir>/<server>.log",
    )
    ap.add_argument(
        "--peer-arg", action="append", default=[], help="extra `transformers serve` argument (repeatable)"
    )
    ap.add_argument("--warmup", type=int, default=2, help="requests after start-up, before measuring")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="start-up and per-request limit")
    ap.add_argument("--work-dir", default="/tmp/epd-bench-vs-transformers", help="model, clips, logs")
    ap.add_argument("--output-json", default="")
    ap.add_argument(
        "--plot", default="", metavar="FILE.png", help="throughput, TTFT, TPOT of both against concurrency"
    )
    args = ap.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if not servers or any(s not in SERVERS for s in servers):
        ap.error(f"--servers takes a comma list of {', '.join(SERVERS)}")
    args.work = Path(args.work_dir)
    args.work.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if args.model:
        model = Path(args.model).resolve()
    else:
        model = args.work / "model-27m"
        if not (model / "config.json").exists():
            log(f"building bench_pruning's 27M Qwen2-VL in {model}")
            build_model(model)
    if args.ignore_eos:
        model = min_tokens_copy(model, args.work / f"{model.name}-min{args.max_tokens}", args.max_tokens)
    clips = make_clips(
        args.work / f"clips-{args.clip_size}px-{args.clip_seconds:g}s",
        args.num_clips * len(args.concurrency) + 1,  # fresh clips per level, one for warming up
        args.clip_size,
        args.clip_seconds,
    )
    args.torchcodec_env = torchcodec_env(args.work, clips[0]) if "transformers" in servers else {}
    log(
        f"model {model}; {len(clips)} clips {args.clip_size}x{args.clip_size}, {args.clip_seconds:g} s; "
        f"{args.num_requests} requests at each of {args.concurrency} in flight; {args.num_frames} frames, "
        f"{args.max_tokens} tokens{' (ignore_eos)' if args.ignore_eos else ''}; {os.cpu_count()} CPUs"
        + (
            f"; torchcodec via {args.torchcodec_env['LD_LIBRARY_PATH'].split(os.pathsep)[0]}"
            if args.torchcodec_env
            else ""
        )
    )

    runs = {name: run_server(name, model, clips, args) for name in servers}

    print(
        f"\n# epd vs transformers serve: {args.num_requests} requests a level, {len(clips)} clips "
        f"{args.clip_size}x{args.clip_size}, {args.num_frames} frames, {args.max_tokens} tokens"
        f"{', ignore_eos' if args.ignore_eos else ''}; epd {args.epd_threads} thread(s) per service, "
        f"transformers {args.peer_threads or 'default'} thread(s); {os.cpu_count()} CPUs; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    for name, r in runs.items():
        prompt = sorted({lv["prompt_tokens"] for lv in r["sweep"]})
        print(f"\n## {name} (prompt tokens per request, median: {prompt})")
        print("\n".join(sweep_table(r["sweep"])))
        errors = sorted({e for lv in r["sweep"] for e in lv["summary"]["errors"]})
        for err in errors:
            print(f"  error: {err}")
    if "transformers" in runs and len(runs) >= 2:
        print(
            "\n## side by side (ratio = epd / transformers; req/s, tok/s: higher is better; TTFT, TPOT: lower)"
        )
        print("\n".join(side_by_side(runs)))
    print(
        "\n## CPU (core-seconds of each server's processes during each level; the load client's are not counted)"
    )
    print("\n".join(cpu_table(runs)))
    print("\n## memory (PSS summed over each server's processes)")
    print("\n".join(memory_table(runs)))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.plot:
        write_plot(
            args.plot,
            {name: r["sweep"] for name, r in runs.items()},
            title=f"epd vs transformers serve: {args.num_frames} frames, {args.max_tokens} tokens",
        )
        print(f"plot: {args.plot}")
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps(
                {"config": {k: v for k, v in vars(args).items() if k != "work"}, "runs": runs},
                indent=2,
                default=str,
            )
        )
    failed = sum(lv["summary"]["num_failed"] for r in runs.values() for lv in r["sweep"])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    run_bench(main)
