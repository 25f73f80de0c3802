"""n choices of one request against n single requests: what one encode and one prefill save.

    PYTHONPATH=. .venv/bin/python bench/bench_n_choices.py                      # n=4, 16 frames at 224x224
    PYTHONPATH=. .venv/bin/python bench/bench_n_choices.py --n 8 --num-frames 32

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (its SPEC with frames kept up to
    --clip-size x --clip-size; built once into --work-dir by bench/common.py's build_model), or
    --model DIR; a fresh `epd serve` stack on free loopback ports, stopped at the end;
  * clips: distinct synthetic clips, one per measured request group (so no group finds another's
    video in the encoder's token cache or prefill's prefix cache), plus one for warm-up;
  * per repetition, three ways to get n sampled answers (temperature 1, seeds s .. s+n-1,
    --max-tokens tokens each, ignore_eos), each on a clip of its own:
      n choices   one chat request with "n": n
      n cold      n chat requests at once, one per seed, each under its own cache_salt (no cache is
                  shared: what n would cost if each choice were encoded and prefilled again)
      n shared    n chat requests at once, one per seed, same tenant (they may share caches, as a
                  client fanning out would)
  * printed: p50 wall time of each group, and the stack's per-core request counters
    (`epd_engine_requests_total`) each group moved: encoder tower jobs (one per group of frames),
    prefills, decodes; the ratios of the singles' wall times to the n choices'; and whether the
    warm-up's n choices equal, token for token, single requests of the same seeds on its clip.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    bound_ports,
    build_model,
    log,
    make_clips,
    run_bench,
    server_command,
    start_server,
    stop,
    wait_ready,
)

SEED = 1130
GROUPS = ("n choices", "n cold", "n shared")


def post(port: int, body: dict, timeout_s: float) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    answer = json.loads(reply.read())
    if reply.status != 200:
        raise SystemExit(f"HTTP {reply.status}: {answer}")
    return answer


def chat_body(clip: Path, args, **fields) -> dict:
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    return {"model": "epd", "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 1.0,
            "return_token_ids": True,  # each choice's token ids (vLLM's field)
            "media": {"num_frames": args.num_frames}, **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "what moves in the video?"}]}]}  # fmt: skip


def engine_requests(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(conn.getresponse().read().decode()):
        for sample in family.samples:
            if sample.name == "epd_engine_requests_total":
                out[sample.labels["stage"]] = out.get(sample.labels["stage"], 0.0) + sample.value
    return out


def run_group(group: str, port: int, clip: Path, args, pool: ThreadPoolExecutor) -> tuple[float, dict, list]:
    """(wall seconds, requests per core it moved, each answer's token ids by seed)."""
    before = engine_requests(port)
    t0 = time.perf_counter()
    if group == "n choices":
        answer = post(port, chat_body(clip, args, n=args.n, seed=SEED), args.timeout_s)
        tokens = [c["token_ids"] for c in answer["choices"]]
    else:
        bodies = [
            chat_body(
                clip, args, seed=SEED + i, **({"cache_salt": f"bench-{i}"} if group == "n cold" else {})
            )
            for i in range(args.n)
        ]
        answers = list(pool.map(lambda b: post(port, b, args.timeout_s), bodies))
        tokens = [a["choices"][0]["token_ids"] for a in answers]
    wall_s = time.perf_counter() - t0
    after = engine_requests(port)
    return wall_s, {stage: after[stage] - before.get(stage, 0.0) for stage in after}, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-n-choices"))
    p.add_argument("--model", default="", help="model directory (default: build the 27M Qwen2-VL)")
    p.add_argument("--n", type=int, default=4, help="choices (and single requests) per group")
    p.add_argument("--repeats", type=int, default=3, help="measured repetitions of the three groups")
    p.add_argument("--num-frames", type=int, default=16)
    p.add_argument("--clip-size", type=int, default=224, help="clip width = height, px")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--threads", default="", help="epd serve --num-threads (default: epd's own)")
    p.add_argument("--colocate", action="store_true", help="epd serve --colocate (one process)")
    p.add_argument("--epd-arg", action="append", default=[], help="a flag passed on to epd serve")
    p.add_argument("--timeout-s", type=float, default=900.0, help="start-up and per-request limit")
    args = p.parse_args(argv)

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else work / f"model-27m-{args.clip_size}px"
    if not model.exists():
        log(f"building the 27M Qwen2-VL (frames up to {args.clip_size}x{args.clip_size}) into {model}")
        build_model(model, args.clip_size * args.clip_size)
    clips = make_clips(
        work / f"clips-{args.clip_size}px", 1 + len(GROUPS) * args.repeats, args.clip_size, 4.0
    )

    ports_file = work / "server.ports.json"
    cmd, env = server_command(model, args, ports_file)
    log_path = work / "server.log"
    with open(log_path, "w") as log_file:
        proc = start_server(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    walls: dict[str, list[float]] = {g: [] for g in GROUPS}
    moved: dict[str, dict] = {}
    equal = False
    try:
        launched = time.perf_counter()  # the stack names its ports once it is ready: count the wait
        port = bound_ports(ports_file, proc, args.timeout_s, log_path)["http"]
        log(
            f"serving after {time.perf_counter() - launched + wait_ready(proc, port, args.timeout_s, log_path):.1f} s; warm-up"
        )
        with ThreadPoolExecutor(args.n) as pool:
            _, _, warm_tokens = run_group("n choices", port, clips[-1], args, pool)
            for r in range(args.repeats):
                tokens = {}
                for k, group in enumerate(GROUPS):
                    wall_s, moved[group], tokens[group] = run_group(
                        group, port, clips[r * len(GROUPS) + k], args, pool
                    )
                    walls[group].append(wall_s)
                    log(f"repeat {r + 1}/{args.repeats} {group}: {wall_s:.2f} s, requests {moved[group]}")
            # the same seeds, one at a time, on the warm-up's clip: the same tokens as its n choices
            singles = [
                post(port, chat_body(clips[-1], args, seed=SEED + i), args.timeout_s) for i in range(args.n)
            ]
            equal = warm_tokens == [a["choices"][0]["token_ids"] for a in singles]
    finally:
        stop(proc)

    print(f"\nepd serve: n={args.n}, {args.num_frames} frames at {args.clip_size}x{args.clip_size}, "
          f"{args.max_tokens} tokens per answer, {args.repeats} repeats; model {model}")  # fmt: skip
    print(f"{'':10} {'wall p50 s':>10} {'tower jobs':>10} {'prefills':>9} {'decodes':>8}")
    base = statistics.median(walls["n choices"])
    for group in GROUPS:
        m = moved[group]
        print(f"{group:10} {statistics.median(walls[group]):>10.2f} {m.get('encoder', 0):>10.0f} "
              f"{m.get('prefill', 0):>9.0f} {m.get('decode', 0):>8.0f}")  # fmt: skip
    for group in GROUPS[1:]:
        print(f"ratio {group} / n choices: {statistics.median(walls[group]) / base:.2f}x")
    print(f"n choices' tokens equal the single requests' of seeds {SEED}..{SEED + args.n - 1}: {equal}")
    return 0


if __name__ == "__main__":
    run_bench(main)
