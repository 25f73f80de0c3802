"""What the bench scripts share: a timestamped log line, the ports of an `epd serve` that binds
port 0 (`epd_port_flags`, `bound_ports`) or a free port for a server that cannot (`free_port`),
stopping a server's process group (`stop`), bench/bench_pruning.py's 27M Qwen2-VL (`build_model`)
and synthetic clips (`make_clips`).

Plain Python at import (no torch, no epd): the load clients import it; what needs more imports it
inside the function or runs in a child process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def free_port() -> int:
    """A port free now, for a server that cannot bind port 0 and say which it got (`transformers
    serve`): another process may take it before that server binds it. epd's servers bind port 0
    themselves (`epd_port_flags`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
