"""What the bench scripts share: a timestamped log line, the ports of an `epd serve` that binds
port 0 (`epd_port_flags`, `bound_ports`; a server that cannot, an older revision's
(`takes_ports_file`) or `transformers serve`, gets epd.transport.ports_file's `free_port`),
starting a server that dies with the bench (`start_server`), stopping a server's process group
(`stop`), bench/bench_pruning.py's 27M Qwen2-VL (`build_model`), synthetic clips (`make_clips`),
and for an `epd serve` the bench starts itself: its command line (`server_command`), the wait
until it serves (`wait_ready`) and one streaming chat request (`ask`, its messages from `user` and
`data_url`, its answer a `Turn`).

Plain Python at import (no torch; of epd only the plain SSE reader, bench/sse.py, and
epd/transport/parent_death.py): the load clients import it; what needs more imports it inside the
function or runs in a child process."""

from __future__ import annotations

import base64
import functools
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from epd.bench.sse import stream_chunks
from epd.transport.parent_death import die_with_parent, libc_prctl

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@functools.cache
def takes_ports_file(root: Path, role: str = "") -> bool:
    """Whether `epd serve [ROLE]` of the tree at `root` takes --ports-file: a bench that also runs
    an older revision (`git archive REV`) from before it gives that one ports picked with `free_port`
    (epd/transport/ports_file.py)."""
    command = [sys.executable, "-m", "epd.cli.main", "serve", *([role] if role else []), "--help"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    shown = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=True)
    return "--ports-file" in shown.stdout


def epd_port_flags(ports_file: Path, stages: bool = True) -> list[str]:
    """`epd serve`'s flags for every port a free one the kernel picks, written to `ports_file`
    (`bound_ports`); `stages` False for --colocate, which has no stage servers."""
    ports_file.unlink(missing_ok=True)  # an earlier run's
    stage_ports = [f"--{stage}-port=0" for stage in ("encoder", "prefill", "decode")] if stages else []
    return ["--gateway-port=0", *stage_ports, "--http-port=auto", f"--ports-file={ports_file}"]


def bound_ports(ports_file: Path, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> dict:
    """The ports `epd serve ... epd_port_flags(ports_file)` bound, once it has written them (its
    services bind before they load the model); the log's tail if it exits or takes `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ports_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"epd serve did not bind its ports (exit {proc.poll()}); log:\n{tail}")
        time.sleep(0.1)
    return json.loads(ports_file.read_text())


def start_server(command: list[str], **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)` for a server the bench starts: in a session of its own
    unless `popen` names a process group (`process_group=0`), so that `stop` ends its group and a
    Ctrl-C reaches the bench alone (whose `finally` stops it), and sent SIGTERM when the bench dies,
    even by SIGKILL, which no handler of the bench sees (epd/transport/parent_death.py; `epd serve`
    then stops its own services as on any SIGTERM). From the main thread only: the kernel sends the
    signal when the *thread* that forked the child ends, so a server started from a worker thread
    would be stopped with that thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "start_server: start servers from the main thread (the parent-death signal fires when "
            "the thread that forked the server ends)"
        )
    if "process_group" not in popen:
        popen.setdefault("start_new_session", True)
    # between fork and exec: one libc call, looked up before the fork (the bench may run threads, and
    # code run there in a threaded process can deadlock)
    arm = functools.partial(die_with_parent, os.getpid(), 128 + signal.SIGTERM, libc_prctl())
    return subprocess.Popen(command, preexec_fn=arm, **popen)


def run_bench(main: Callable[[], int | None]) -> NoReturn:
    """A bench script's `__main__`: `main()`, its result the exit code, with SIGTERM raising
    SystemExit so the bench's `finally` still stops the servers it started. Most run in a session
    or process group of their own (`start_new_session`, so that `stop` ends each one's group) and
    get none of the signals sent to the bench: a bench ended by SIGTERM's default (`timeout`, a
    process manager, a tool's kill) left them running, stacks of 7 processes each. A bench killed
    by SIGKILL runs no `finally`: its servers get SIGTERM from the kernel (`start_server`)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    raise SystemExit(main())


def _exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def build_model(model_dir: Path, max_pixels: int | None = None) -> None:
    """bench/bench_pruning.py's 27M Qwen2-VL, with frames kept up to `max_pixels` when given, in a
    child process (no torch in this load client). Built under another name and renamed when done, so
    that a build cut short is not taken for the model by the next run."""
    code = (
        "import sys; from dataclasses import replace; from bench.bench_pruning import SPEC; "
        "from epd.model_runtime.tiny_model import build_checkpoint; "
        "build_checkpoint(sys.argv[1], replace(SPEC, max_pixels=int(sys.argv[2])) if sys.argv[2:] else SPEC)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tmp = model_dir.with_name(model_dir.name + ".tmp")
    pixels = [] if max_pixels is None else [str(max_pixels)]
    subprocess.run([sys.executable, "-c", code, str(tmp), *pixels], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    tmp.rename(model_dir)


def make_clips(out: Path, num_clips: int, size: int, seconds: float) -> list[Path]:
    """`num_clips` different synthetic clips (epd.synth scenes, seeds 0..n-1), made once."""
    from epd.synth.render import encode_mp4, render_frames
    from epd.synth.scene import SceneConfig, generate_scene

    out.mkdir(parents=True, exist_ok=True)
    config = SceneConfig(width_px=size, height_px=size, fps=8, duration_s=seconds)
    paths = []
    for seed in range(num_clips):
        path = out / f"clip{seed:03d}.mp4"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(encode_mp4(render_frames(generate_scene(seed, config)), config.fps))
            tmp.rename(path)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# the OpenAI API of a server the bench started: a streaming request, the server's command line


def data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


@dataclass
class Turn:
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    answer: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    encoder_cache_hit: bool = False


def ask(
    port: int, messages: list[dict], args, timeout_s: float, cache_salt: str = "", fields: dict | None = None
) -> Turn:
    """One streaming /v1/chat/completions (with `fields` added to its body): TTFT at the first chunk
    that carries tokens; the answer, its token ids and timings from the final chunk's `epd`
    details; tokens from `usage`."""
    body: dict = {
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "media": {"num_frames": args.num_frames},
        "return_token_ids": True,  # a chunk's token ids: TTFT at the first token, text or not
        **(fields or {}),
    }
    if cache_salt:
        body["cache_salt"] = cache_salt
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    turn = Turn()
    parts: list[str] = []
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        for chunk in stream_chunks(iter(lambda: resp.read1(1 << 16), b"")):
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if (choice.get("token_ids") or text) and not turn.ttft_ms:
                    turn.ttft_ms = (time.perf_counter() - t0) * 1e3
                parts.append(text)
            details = chunk.get("epd")
            if details:
                turn.token_ids = list(details.get("token_ids") or [])
                turn.prefill_ms = float((details.get("timings_ms") or {}).get("prefill", 0.0))
                turn.encoder_cache_hit = bool(details.get("encoder_cache_hit"))
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                turn.cached_tokens = None if cached is None else int(cached)
    finally:
        conn.close()
    if not turn.ttft_ms:
        raise RuntimeError("the stream carried no tokens")
    turn.answer = "".join(parts)
    return turn


def user(text: str, video_url: str | None = None) -> dict:
    if video_url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url}},
                                        {"type": "text", "text": text}]}  # fmt: skip


def server_command(model: Path, args, ports_file: Path) -> tuple[list[str], dict[str, str]]:
    """Every port one the kernel picks, named in `ports_file` (`bound_ports`). --colocate has no
    stage servers: their ports would be refused as flags that do nothing."""
    ports = epd_port_flags(ports_file, stages=not args.colocate)
    cmd = [sys.executable, "-m", "epd.cli.main", "serve", "--model", str(model), *ports,
           *(["--colocate"] if args.colocate else []),
           *(["--num-threads", args.threads] if args.threads else []), *args.epd_arg]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads.isdigit():
        env["OMP_NUM_THREADS"] = args.threads
    return cmd, env


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"the server exited with {proc.returncode} before serving; log:\n{tail}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server did not serve within {timeout_s:.0f} s; log: {log_path}")
