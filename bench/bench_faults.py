"""Replicas killed under load: how many requests still complete with the right answer (issue #16).

    PYTHONPATH=. .venv/bin/python bench/bench_faults.py                    # 60 requests a stage, 20 in flight
    PYTHONPATH=. .venv/bin/python bench/bench_faults.py --tiny --num-requests 20 --num-frames 4   # smoke run

Target (#16): with one encoder, then one prefill, then one decode replica killed (SIGKILL) while
requests are in flight on two replicas of each stage, >= 95% of the requests complete with the
same tokens as without the fault, and none hangs.

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (the one
    bench/bench_vs_transformers_serve.py builds into /tmp/epd-bench-vs-transformers/model-27m; built
    there if missing), --tiny for the ~1M test model (built into --work-dir), or --model DIR;
  * requests: for each stage, --num-requests questions over its own --num-clips synthetic clips
    (epd.synth scenes, bench/common.py's `make_clips`; no clip shared between stages, so the
    caches of the fault stack are cold for each stage's clips), greedy, --max-tokens tokens with
    ignore_eos, --num-frames frames, over the gRPC front door (the SDK, no client retries unless
    --client-retries: what the stack itself saves), --in-flight at once, each with a deadline of
    --deadline-s;
  * reference: a fresh `epd serve --encoders 2 --prefills 2 --decodes 2` answers every request with
    no fault; it is stopped;
  * faults: a second, fresh stack of the same command; for each stage in --stages: the same
    requests, and once --kill-after of them have completed, SIGKILL to one replica of the stage
    (encoder, prefill: the one most of the stage's clips are homed at; decode: the first); then
    the launcher restarts it, and the next stage starts once it serves again;
  * printed: the command line and the date, then per stage killed: requests, completed with the
    reference tokens, completed with other tokens, failed (by status), hung (no answer within the
    deadline: DEADLINE_EXCEEDED, or not ended at all), completion %, and how long the killed
    replica took to serve again; then the verdict against the target. --output-json writes the same.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import psutil  # noqa: E402

from bench.common import build_model, log, make_clips, run_bench, start_server  # noqa: E402
from epd.client import AsyncEpdClient, EpdError, TokenDelta  # noqa: E402
from epd.client.retry import NO_RETRY, RetryPolicy  # noqa: E402
from epd.transport.affinity import rendezvous_order  # noqa: E402


def is_serving(address: str, timeout_s: float = 1.0) -> bool:
    """Whether `address` answers grpc.health SERVING (health needs no internal secret)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


STAGES = ("encoder", "prefill", "decode")
QUESTIONS = ("what moves in the video?", "what colour is the largest object?", "describe the scene.",
             "how many objects are there?")  # fmt: skip
TARGET_COMPLETE = 0.95
HANG_MARGIN_S = 30.0
"""Beyond its deadline a request still running is counted hung and cancelled."""


@dataclass
class Stack:
    launcher: subprocess.Popen
    log_path: Path
    gateway: str
    replicas: dict[str, list[str]]


@dataclass
class Outcome:
    index: int
    tokens: list[int] | None = None
    code: str = ""  # the status name of a failure
    message: str = ""
    hung: bool = False


@dataclass
class StageResult:
    stage: str
    victim: str
    requests: int = 0
    correct: int = 0
    wrong: int = 0
    hung: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    failure_examples: dict[str, str] = field(default_factory=dict)
    killed_after: int = 0
    """Requests completed when the replica was killed."""
    back_after_s: float | None = None
    """From the kill until a new process serves the replica's port (None: not within the wait)."""

    @property
    def complete_pct(self) -> float:
        return 100.0 * self.correct / self.requests if self.requests else 0.0


def start_stack(model: Path, args, log_path: Path) -> Stack:
    """`epd serve --encoders 2 --prefills 2 --decodes 2`, every port one the kernel picks (named in
    its --ports-file, written before its ready line; a restarted replica keeps its port); returns
    once it is ready."""
    ports_file = log_path.with_suffix(".ports.json")
    ports_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "epd.cli.main", "serve", "--model", str(model),
           "--encoders", "2", "--prefills", "2", "--decodes", "2",
           *[f"--{role}-port=0" for role in STAGES], "--gateway-port=0", "--http-port", "0",
           f"--ports-file={ports_file}",
           "--max-requests-per-client", str(4 * args.in_flight), "--health-timeout", "30", *args.epd_arg]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if args.threads:
        env["OMP_NUM_THREADS"] = args.threads
    with open(log_path, "w") as stderr:
        launcher = start_server(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO,
                                process_group=0)  # fmt: skip
    ready = launcher.stdout.readline() if launcher.stdout else ""
    if "stack ready" not in ready:
        stop_stack(launcher)
        raise SystemExit(f"the stack did not start (exit {launcher.poll()}): {ready!r}\n"
                         f"{log_path.read_text(errors='replace')[-3000:]}")  # fmt: skip
    bound = json.loads(ports_file.read_text())
    replicas = {role: [f"127.0.0.1:{port}" for port in bound[role]] for role in STAGES}
    return Stack(launcher, log_path, f"127.0.0.1:{bound['grpc']}", replicas)


def stop_stack(launcher: subprocess.Popen) -> None:
    """SIGTERM to the launcher (it stops its services in order), SIGKILL to the group after 60 s."""
    try:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
    except ProcessLookupError:
        pass


def serving_pid(port: int) -> int | None:
    """The pid of the process listening on loopback port `port` (by its socket: a replica started
    on port 0 has 0 on its command line)."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid is not None:
            return conn.pid
    return None


async def ask(client: AsyncEpdClient, clip: bytes, question: str, index: int, args) -> Outcome:
    outcome = Outcome(index)
    tokens: list[int] = []
    try:
        async for item in client.stream(clip, question, num_frames=args.num_frames, max_new_tokens=args.max_tokens,
                                        ignore_eos=True, timeout_s=args.deadline_s):  # fmt: skip
            if isinstance(item, TokenDelta):
                tokens += item.token_ids
        outcome.tokens = tokens
    except EpdError as exc:
        outcome.code, outcome.message = exc.code.name, exc.message
        outcome.hung = exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
    return outcome


async def run_load(gateway: str, requests: list[tuple[bytes, str]], args, on_done=None) -> list[Outcome]:
    """`requests` with `args.in_flight` at once, in order; `on_done(completed)` after each ends."""
    retry = RetryPolicy() if args.client_retries else NO_RETRY
    outcomes: list[Outcome | None] = [None] * len(requests)
    gate = asyncio.Semaphore(args.in_flight)
    completed = 0

    async def one(i: int) -> None:
        nonlocal completed
        async with gate:
            try:
                outcomes[i] = await asyncio.wait_for(ask(client, *requests[i], i, args),
                                                     args.deadline_s + HANG_MARGIN_S)  # fmt: skip
            except asyncio.TimeoutError:
                outcomes[i] = Outcome(i, hung=True)
        completed += 1
        if on_done is not None:
            on_done(completed)

    async with AsyncEpdClient(gateway, timeout_s=args.deadline_s, retry=retry) as client:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    return [o for o in outcomes if o is not None]


def stage_requests(clips: list[bytes], args) -> list[tuple[bytes, str]]:
    return [
        (clips[i % len(clips)], QUESTIONS[(i // len(clips)) % len(QUESTIONS)])
        for i in range(args.num_requests)
    ]


def victim_of(stage: str, stack: Stack, clips: list[bytes]) -> str:
    replicas = stack.replicas[stage]
    if stage == "decode":  # no affinity: least loaded, ties in turn
        return replicas[0]
    homes = Counter(rendezvous_order(hashlib.sha256(c).hexdigest(), replicas)[0] for c in clips)
    return homes.most_common(1)[0][0]


def run_stage(
    stage: str,
    stack: Stack,
    requests: list[tuple[bytes, str]],
    reference: list[Outcome],
    clips: list[bytes],
    args,
) -> StageResult:
    victim = victim_of(stage, stack, clips)
    port = int(victim.rsplit(":", 1)[1])
    pid = serving_pid(port)
    if pid is None:
        raise SystemExit(f"nothing serves {stage} replica {victim}")
    result = StageResult(stage, victim, requests=len(requests))
    killed_at: list[float] = []

    def on_done(completed: int) -> None:
        if not killed_at and completed >= args.kill_after:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            result.killed_after = completed
            log(f"{stage}: killed {victim} (pid {pid}) after {completed} requests completed")

    outcomes = asyncio.run(run_load(stack.gateway, requests, args, on_done))
    assert killed_at, "--kill-after is below --num-requests (checked in main)"
    for o, ref in zip(outcomes, reference):
        if o.hung:
            result.hung += 1
        elif o.tokens is not None:
            if o.tokens == ref.tokens:
                result.correct += 1
            else:
                result.wrong += 1
        else:
            result.failed[o.code] = result.failed.get(o.code, 0) + 1
            result.failure_examples.setdefault(o.code, o.message)
    deadline = time.monotonic() + args.restart_wait_s
    while time.monotonic() < deadline:
        new = serving_pid(port)
        if new not in (None, pid) and is_serving(victim, timeout_s=1.0):
            result.back_after_s = time.monotonic() - killed_at[0]
            break
        if stack.launcher.poll() is not None:
            raise SystemExit(f"the stack stopped (exit {stack.launcher.poll()}):\n"
                             f"{stack.log_path.read_text(errors='replace')[-3000:]}")  # fmt: skip
        time.sleep(0.2)
    return result


def report(results: list[StageResult], args, model: Path, argv: list[str]) -> tuple[list[str], bool]:
    total = sum(r.requests for r in results)
    correct = sum(r.correct for r in results)
    hung = sum(r.hung for r in results)
    ok = total > 0 and correct / total >= TARGET_COMPLETE and hung == 0
    lines = [
        f"bench_faults: {' '.join(shlex.quote(a) for a in ['bench/bench_faults.py', *argv])}",
        f"date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; host cores {os.cpu_count()}; "
        f"model {model}",
        f"{args.num_requests} requests per stage over {args.num_clips} clips, {args.in_flight} in flight, "
        f"{args.num_frames} frames, {args.max_tokens} tokens, deadline {args.deadline_s:g} s, client retries "
        f"{'on' if args.client_retries else 'off'}; one replica killed (SIGKILL) after {args.kill_after} completed",
        "",
        f"{'killed':<8} {'requests':>8} {'correct':>8} {'wrong':>6} {'hung':>5} {'complete':>9} {'back in':>8}  failed",
    ]
    for r in results:
        failed = ", ".join(f"{code} {n}" for code, n in sorted(r.failed.items())) or "-"
        back = f"{r.back_after_s:.1f} s" if r.back_after_s is not None else "no"
        lines.append(f"{r.stage:<8} {r.requests:>8} {r.correct:>8} {r.wrong:>6} {r.hung:>5} "
                     f"{r.complete_pct:>8.1f}% {back:>8}  {failed}")  # fmt: skip
    for r in results:
        for code, message in sorted(r.failure_examples.items()):
            lines.append(f"  {r.stage} {code}: {message}")
    pct = 100.0 * correct / total if total else 0.0
    lines.append("")
    lines.append(f"overall: {correct}/{total} complete with the reference tokens ({pct:.1f}%), {hung} hung; "
                 f"target >= {TARGET_COMPLETE:.0%} and 0 hung: {'MET' if ok else 'NOT MET'}")  # fmt: skip
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--work-dir", type=Path, default=Path("/tmp/epd-bench-faults"), help="clips, logs, tiny model"
    )
    p.add_argument("--model", default="", help="model directory (default: the 27M Qwen2-VL, see above)")
    p.add_argument(
        "--tiny", action="store_true", help="the ~1M-parameter test model instead (fast; smoke runs)"
    )
    p.add_argument("--num-requests", type=int, default=60, help="requests per stage killed")
    p.add_argument("--in-flight", type=int, default=20)
    p.add_argument("--num-clips", type=int, default=12, help="clips per stage")
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--clip-size", type=int, default=224, help="clip width = height, px")
    p.add_argument("--clip-seconds", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--kill-after",
        type=int,
        default=0,
        help="kill once this many requests have completed (default: a quarter of them)",
    )
    p.add_argument("--deadline-s", type=float, default=120.0, help="each request's deadline")
    p.add_argument(
        "--restart-wait-s", type=float, default=120.0, help="how long to wait for the killed replica"
    )
    p.add_argument("--stages", default=",".join(STAGES), help="stages to kill a replica of, in order")
    p.add_argument(
        "--client-retries",
        action="store_true",
        help="the SDK's default retries (UNAVAILABLE before the first token) on top of the stack's",
    )
    p.add_argument("--threads", default="", help="OMP_NUM_THREADS of every process (default: inherited)")
    p.add_argument("--epd-arg", action="append", default=[], help="extra `epd serve` argument (repeatable)")
    p.add_argument("--output-json", default="")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    if not set(stages) <= set(STAGES):
        p.error(f"--stages: pick from {', '.join(STAGES)}")
    args.kill_after = args.kill_after or max(1, args.num_requests // 4)
    if args.kill_after >= args.num_requests:
        p.error("--kill-after must be below --num-requests")

    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    elif args.tiny:
        model = args.work_dir / "model-tiny"
        if not model.exists():
            log(f"building the tiny Qwen2-VL into {model}")
            code = ("import sys; from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint; "
                    "build_checkpoint(sys.argv[1], TinyVLMSpec())")  # fmt: skip
            subprocess.run([sys.executable, "-c", code, str(model)], cwd=REPO, check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    else:
        model = Path("/tmp/epd-bench-vs-transformers/model-27m")
        if not model.exists():
            log(f"building the 27M Qwen2-VL into {model}")
            model.parent.mkdir(parents=True, exist_ok=True)
            build_model(model)
    log(f"making {args.num_clips * len(stages)} clips")
    paths = make_clips(args.work_dir / f"clips-{args.clip_size}px-{args.clip_seconds:g}s",
                       args.num_clips * len(stages), args.clip_size, args.clip_seconds)  # fmt: skip
    clips = [path.read_bytes() for path in paths]
    by_stage = {s: clips[i * args.num_clips : (i + 1) * args.num_clips] for i, s in enumerate(stages)}
    requests = {s: stage_requests(by_stage[s], args) for s in stages}

    log("reference: a fresh stack, every request with no fault")
    stack = start_stack(model, args, args.work_dir / "reference.log")
    try:
        reference = {s: asyncio.run(run_load(stack.gateway, requests[s], args)) for s in stages}
    finally:
        stop_stack(stack.launcher)
    unanswered = [
        (s, o.index, o.code or "hung", o.message) for s in stages for o in reference[s] if o.tokens is None
    ]
    if unanswered:
        raise SystemExit(f"the fault-free reference run failed requests: {unanswered[:5]}")

    log("faults: a fresh stack of the same command")
    stack = start_stack(model, args, args.work_dir / "faults.log")
    results = []
    try:
        for s in stages:
            results.append(run_stage(s, stack, requests[s], reference[s], by_stage[s], args))
            r = results[-1]
            log(f"{s}: {r.correct}/{r.requests} correct, {r.hung} hung, failed {r.failed or '-'}")
    finally:
        stop_stack(stack.launcher)
    lines, ok = report(results, args, model, argv)
    print("\n" + "\n".join(lines))
    print(f"(stack logs: {args.work_dir}/reference.log, {args.work_dir}/faults.log)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({
            "argv": argv, "date": datetime.now(timezone.utc).isoformat(), "model": str(model), "target_met": ok,
            "stages": [{**r.__dict__, "complete_pct": r.complete_pct} for r in results],
        }, indent=2))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    run_bench(main)
