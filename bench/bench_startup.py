"""Start-up: seconds from process launch to the first answered request, epd against `transformers serve`.

    python bench/bench_startup.py --runs 3 [--model DIR] [--media image|video] [--baseline-rev REV]

Per run, each server is started fresh on free ports (epd's bound by each service itself and read
from `--ports-file`; a revision from before it and `transformers serve` are given ports picked
here) and one fixed question (greedy, 8 tokens) is
sent to its OpenAI-compatible /v1/chat/completions every 50 ms until it answers 200:
  epd           `epd serve` (the launcher, three stages and the gateway with its HTTP API); the
                media goes as a `data:` URL;
  transformers  `transformers serve MODEL` on the same model directory (needs the `bench` extra,
                `pip install -e .[bench]`); the media goes as a file path (it refuses data: video).
  epd@REV       with --baseline-rev: `epd serve` from `git archive REV` (e.g. the commit before a
                change), the same model and request.
The runs alternate between the servers, so load from elsewhere spreads over all of them. Printed:
every run's seconds, the medians, and the ratio epd / transformers of the medians (the target of
issue #22 is <= 1.5).

Also printed: the import time of each front-door process (`python -X importtime -c "import M"`,
the module's cumulative microseconds, median of 3), here and at --baseline-rev, and whether
importing it loads torch.

`transformers serve` 5.23 cannot read mp4 video without torchcodec (it opens the file's audio
track), so the default question is about samples/sample.png; --media video measures epd alone.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import epd_port_flags, run_bench, start_server, stop, takes_ports_file  # noqa: E402
from epd.resources import demo_model_dir, shipped  # noqa: E402
from epd.transport.ports_file import free_port  # noqa: E402

QUESTION = "what colour is the circle?"
MAX_TOKENS = 8
POLL_S = 0.05
FRONT_DOOR_MODULES = ("epd.gateway.server", "epd.cli.serve")
"""What the gateway process (`epd serve gateway`) and the launcher (`epd serve`) import."""


def media_path(kind: str) -> Path:
    return shipped("samples") / ("sample.mp4" if kind == "video" else "sample.png")


def chat_body(model: str, media_url: str, kind: str) -> bytes:
    part_type = "video_url" if kind == "video" else "image_url"
    return json.dumps(
        {
            "model": model,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": part_type, part_type: {"url": media_url}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": False,
        }
    ).encode()


def first_answer(
    proc: subprocess.Popen, url: Callable[[], str | None], body: bytes, timeout_s: float, t0: float
) -> tuple[float, str]:
    """Polls until a 200 answer: (seconds since t0, the answer's text). `url`: None while the
    server has not said where it listens (`epd serve`'s ports file)."""
    last = "its ports file not written"
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering ({last})")
        if (address := url()) is None:
            time.sleep(POLL_S)
            continue
        request = urllib.request.Request(address, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=max(1.0, timeout_s)) as response:
                text = json.loads(response.read())["choices"][0]["message"]["content"]
                return time.perf_counter() - t0, text
        except urllib.error.HTTPError as exc:  # 503 while stages load; anything else is kept
            last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except (OSError, urllib.error.URLError) as exc:  # not listening yet
            last = repr(exc)
        time.sleep(POLL_S)
    raise TimeoutError(f"no answer within {timeout_s:.0f} s ({last})")


def run_server(
    cmd: list[str], url: Callable[[], str | None], body: bytes, timeout_s: float, cwd: Path, env: dict
) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = start_server(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return first_answer(proc, url, body, timeout_s, t0)
    finally:
        stop(proc)


def epd_once(root: Path, model: str, kind: str, timeout_s: float) -> tuple[float, str]:
    """`epd serve` of the tree at `root` on ports it binds itself, read from its --ports-file once
    it is ready; on free ports picked here for a revision from before --ports-file."""
    ports_file = Path(tempfile.mkdtemp(prefix="epd-startup-ports-")) / "ports.json"
    if takes_ports_file(root):
        port_flags, http_port = epd_port_flags(ports_file), None
    else:
        ports = {name: free_port() for name in ("gateway", "encoder", "prefill", "decode", "http")}
        port_flags, http_port = [f"--{name}-port={port}" for name, port in ports.items()], ports["http"]

    def url() -> str | None:
        port = http_port or (json.loads(ports_file.read_text())["http"] if ports_file.exists() else None)
        return None if port is None else f"http://127.0.0.1:{port}/v1/chat/completions"

    cmd = [sys.executable, "-m", "epd.cli.main", "serve", "--model", model, "--num-threads", "1", *port_flags]
    data = base64.b64encode(media_path(kind).read_bytes()).decode()
    mime = "video/mp4" if kind == "video" else "image/png"
    body = chat_body("epd", f"data:{mime};base64,{data}", kind)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    try:
        return run_server(cmd, url, body, timeout_s, root, env)
    finally:
        shutil.rmtree(ports_file.parent, ignore_errors=True)


def transformers_once(model: str, kind: str, timeout_s: float) -> tuple[float, str]:
    exe = Path(sys.executable).parent / "transformers"
    port = free_port()
    cmd = [str(exe), "serve", model, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    body = chat_body(model, str(media_path(kind)), kind)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return run_server(cmd, lambda: url, body, timeout_s, REPO, env)


def import_time_us(root: Path, module: str, repeats: int = 3) -> tuple[float, bool]:
    """Median cumulative import time of `module` in a fresh interpreter, and whether torch loaded."""
    times, torch_loaded = [], False
    for _ in range(repeats):
        proc = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-c",
                f"import sys, {module}; print('torch' in sys.modules)",
            ],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=True,
        )
        torch_loaded = proc.stdout.strip() == "True"
        row = next(line for line in proc.stderr.splitlines() if line.rstrip().endswith(f"| {module}"))
        times.append(float(row.split("|")[1]))
    return statistics.median(times), torch_loaded


def checkout(rev: str) -> Path:
    """`git archive REV` unpacked in a temporary directory (read-only use of the repository)."""
    root = Path(tempfile.mkdtemp(prefix="epd-startup-"))
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh starts of each server (median reported)")
    ap.add_argument("--model", default=str(demo_model_dir()), help="a Qwen2-VL checkpoint directory")
    ap.add_argument(
        "--media",
        choices=["image", "video"],
        default="image",
        help="video: epd only (transformers serve 5.23 needs torchcodec for mp4)",
    )
    ap.add_argument("--baseline-rev", default="", help="also start `epd serve` from this git revision")
    ap.add_argument("--no-transformers", action="store_true", help="epd only")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per start")
    ap.add_argument("--imports-only", action="store_true", help="only the import times")
    args = ap.parse_args()
    model = str(Path(args.model).resolve())
    baseline = checkout(args.baseline_rev) if args.baseline_rev else None
    try:
        print(
            f"# startup: {args.runs} runs, model {model}, {args.media} question {QUESTION!r}, "
            f"{os.cpu_count()} CPUs"
        )
        print("# import time of the front-door processes (median of 3, ms; torch loaded?)")
        for module in FRONT_DOOR_MODULES:
            now_us, now_torch = import_time_us(REPO, module)
            line = f"  {module:22s} now {now_us / 1e3:8.1f} ms (torch: {now_torch})"
            if baseline is not None:
                before_us, before_torch = import_time_us(baseline, module)
                line += (
                    f"   {args.baseline_rev}: {before_us / 1e3:8.1f} ms (torch: {before_torch})"
                    f"   ratio now/{args.baseline_rev} {now_us / before_us:.2f}"
                )
            print(line, flush=True)

        if args.imports_only:
            return 0
        servers = {"epd": lambda: epd_once(REPO, model, args.media, args.timeout_s)}
        if not args.no_transformers and args.media == "image":
            servers["transformers"] = lambda: transformers_once(model, args.media, args.timeout_s)
        if baseline is not None:
            root = baseline
            servers[f"epd@{args.baseline_rev}"] = lambda: epd_once(root, model, args.media, args.timeout_s)
        times: dict[str, list[float]] = {name: [] for name in servers}
        print("# seconds from launch to the first answer")
        for run in range(args.runs):
            for name, once in servers.items():
                seconds, answer = once()
                times[name].append(seconds)
                print(f"  run {run + 1} {name:14s} {seconds:6.2f} s  answer {answer!r}", flush=True)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, m in medians.items():
            print(f"median {name:14s} {m:6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
        if "transformers" in medians:
            print(f"ratio epd / transformers: {medians['epd'] / medians['transformers']:.2f} (target <= 1.5)")
        if baseline is not None:
            key = f"epd@{args.baseline_rev}"
            print(f"ratio epd / {key}: {medians['epd'] / medians[key]:.2f}")
            if "transformers" in medians:
                print(f"ratio {key} / transformers: {medians[key] / medians['transformers']:.2f}")
    finally:
        if baseline is not None:
            shutil.rmtree(baseline, ignore_errors=True)
    return 0


if __name__ == "__main__":
    run_bench(main)
