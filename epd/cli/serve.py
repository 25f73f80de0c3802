"""`epd serve [ROLE]`: one service in this process, or the whole stack as child processes."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import signal
import subprocess
import sys
import time

from epd.cli import configs
from epd.cli.health import is_serving

_PR_SET_PDEATHSIG = 1


def run_serve(args: argparse.Namespace) -> int:
    if args.role == "encoder":
        from epd.encoder_svc import server as encoder

        asyncio.run(encoder.main(configs.encoder_config(args)))
    elif args.role == "prefill":
        from epd.prefill_svc import server as prefill

        asyncio.run(prefill.main(configs.prefill_config(args)))
    elif args.role == "decode":
        from epd.decode_svc import server as decode

        asyncio.run(decode.main(configs.decode_config(args)))
    elif args.role == "gateway":
        from epd.gateway import server as gateway

        asyncio.run(gateway.main(configs.gateway_config(args)))
    else:
        return serve_stack(args)
    return 0


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `epd serve` dies, so no service outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def stack_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    """The command line of each service of the loopback stack."""
    base = [sys.executable, "-m", "epd.cli.main", "--log-level", args.log_level, "serve"]
    model = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
             "--num-threads", str(args.num_threads)]
    e, p, d = args.encoder_port, args.prefill_port, args.decode_port
    return {
        "encoder": [*base, "encoder", "--port", str(e), *model],
        "prefill": [*base, "prefill", "--port", str(p), *model],
        "decode": [*base, "decode", "--port", str(d), *model],
        "gateway": [*base, "gateway", "--port", str(args.gateway_port), "--encoder", f"127.0.0.1:{e}",
                    "--prefill", f"127.0.0.1:{p}", "--decode", f"127.0.0.1:{d}",
                    "--http-port", str(args.http_port)],
    }


def serve_stack(args: argparse.Namespace, ready_timeout_s: float = 600.0) -> int:
    if args.model == "default":
        # Build the default model once here, not three times racing in the children.
        from epd.model_runtime.default_model import default_model_path

        args.model = str(default_model_path())
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    commands = stack_commands(args)
    procs = {name: subprocess.Popen(cmd, preexec_fn=_die_with_parent) for name, cmd in commands.items()}
    ports = {"encoder": args.encoder_port, "prefill": args.prefill_port, "decode": args.decode_port,
             "gateway": args.gateway_port}
    try:
        deadline = time.monotonic() + ready_timeout_s
        pending = set(procs)
        while pending and not stop:
            for name in list(pending):
                if procs[name].poll() is not None:
                    print(f"epd: {name} exited with code {procs[name].returncode}", file=sys.stderr)
                    return 1
                if is_serving(f"127.0.0.1:{ports[name]}", timeout_s=1.0):
                    pending.discard(name)
            if time.monotonic() > deadline:
                print(f"epd: not ready after {ready_timeout_s:.0f} s: {sorted(pending)}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        if not stop:
            print(f"epd: stack ready; gateway at 127.0.0.1:{args.gateway_port}", flush=True)
        while not stop:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    print(f"epd: {name} exited with code {proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        _stop_all(procs)


def _stop_all(procs: dict[str, subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
