"""Follow-up questions about one video: what the prefix cache saves on a conversation's later turns.

    PYTHONPATH=. .venv/bin/python bench/bench_conversation.py                   # 8 clips, 64 frames at 448x448
    PYTHONPATH=. .venv/bin/python bench/bench_conversation.py --colocate        # epd serve --colocate
    PYTHONPATH=. .venv/bin/python bench/bench_conversation.py --num-clips 2 --num-frames 8 --clip-size 224
    PYTHONPATH=. .venv/bin/python bench/bench_conversation.py --video-after-text --num-frames 8 --clip-size 224

What it does, in one run:
  * model: the 27M-parameter Qwen2-VL of bench/bench_pruning.py (randomly initialised; built once
    into --work-dir by the same builder, its processor's pixel limit set to --clip-size squared so
    that frames are not shrunk: 448x448 -> 32x32 patches, 256 tokens per temporal group, 8,192
    visual tokens at 64 frames), or --model DIR;
  * clips: --num-clips different synthetic clips (epd.synth scenes, --clip-size square, 8 fps,
    --clip-seconds long; bench/common.py's `make_clips`) plus one for warm-up, and of
    each, two byte-different copies: the same packets remuxed under another metadata tag (the same
    decoded frames, so the same visual tokens and prompt, but another sha256);
  * server: a fresh `epd serve` (or `epd serve --colocate`) on free loopback ports, started by this
    script and stopped at the end; --epd-arg passes flags on;
  * per clip, one 3-turn conversation over the streaming OpenAI API (greedy, --max-tokens tokens
    per answer, ignore_eos so every answer has that length, --num-frames frames):
      turn 1   [video, Q1]                                   the first question (cold)
      turn 2   [video, Q1], A1, Q2                           the follow-up (same conversation: the
                                                             encoder's token cache and the prefill
                                                             replica's prefix cache hold the video)
      turn 2c  the same messages, the video being copy 1     the same follow-up asked cold
      turn 3   ... A2, Q3 / turn 3c on copy 2                likewise for the third turn
    "Asked cold" = the whole follow-up conversation sent in a new conversation about a video the
    server has never seen (a fresh copy: both caches miss), on the same warm server; the answer must
    be the same tokens as the follow-up's.
  * printed: progress per clip, then a table of p50 TTFT (first streamed token, measured here),
    p50 prefill_ms (the response's `epd.timings_ms.prefill`), prompt and cached tokens
    (`usage.prompt_tokens_details.cached_tokens`, when the server reports them) per row, the ratios
    cold / follow-up, and the number of follow-up answers whose tokens differ from the cold ones.

--video-after-text: the conversation whose video comes after a text-only turn instead:
      turn 1   "hello"                                       text only (cold)
      turn 2   "hello", A1, [video, "now look at this video"] the video turn: prefill reuses turn 1's
                                                             cached prefix, up to the video (the
                                                             text-only entry serves the text before it)
      turn 2c  the same messages, the video being copy 1,    the same turn with nothing to reuse (a
               and a new `cache_salt`                        new salt: another tenant's caches)
    on the same warm server; cached tokens are the prefix reused (`num_reused_prompt_tokens`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    Turn,
    ask,
    bound_ports,
    build_model,
    data_url,
    log,
    make_clips,
    run_bench,
    server_command,
    start_server,
    stop,
    user,
    wait_ready,
)

QUESTIONS = (
    "what moves in the video?",
    "and what colour is it?",
    "where is it at the end?",
)
ROWS = (
    ("turn 1: first question (cold)", 1, False),
    ("turn 2: follow-up", 2, False),
    ("turn 2: same, asked cold", 2, True),
    ("turn 3: follow-up", 3, False),
    ("turn 3: same, asked cold", 3, True),
)
QUESTIONS_AFTER_TEXT = ("hello", "now look at this video: what moves in it?")
ROWS_AFTER_TEXT = (
    ("turn 1: hello (text only)", 1, False),
    ("turn 2: video after text", 2, False),
    ("turn 2: same, new cache_salt", 2, True),
)


# ---------------------------------------------------------------------------------------------
# inputs


def remux_copy(src: Path, dst: Path, tag: str) -> Path:
    """`src`'s packets in a new MP4 under metadata comment `tag`: the same frames, other bytes."""
    import av

    from epd.video.media_open import open_video

    if dst.exists():
        return dst
    tmp = dst.with_suffix(".tmp")
    with open_video(src.read_bytes()) as inp, av.open(str(tmp), "w", format="mp4") as out:
        out.metadata["comment"] = tag
        stream_in = inp.streams.video[0]
        stream_out = out.add_stream_from_template(stream_in)
        for packet in inp.demux(stream_in):
            if packet.dts is None:
                continue
            packet.stream = stream_out
            out.mux(packet)
    tmp.rename(dst)
    return dst


# ---------------------------------------------------------------------------------------------
# one conversation


def conversation(port: int, clip: Path, copies: list[Path], args, label: str) -> dict[tuple[int, bool], Turn]:
    """The 3-turn conversation about `clip`, each later turn also asked cold (about copies[k])."""
    url = data_url(clip)
    copy_urls = [data_url(c) for c in copies]
    out: dict[tuple[int, bool], Turn] = {}
    history: list[dict] = []  # the messages after the first user message (answers, later questions)
    for n, question in enumerate(QUESTIONS, start=1):
        if n == 1:
            history = []
        else:
            history += [{"role": "assistant", "content": out[(n - 1, False)].answer}, user(question)]
        first = QUESTIONS[0]
        out[(n, False)] = ask(port, [user(first, url), *history], args, args.timeout_s)
        if n > 1:
            out[(n, True)] = ask(port, [user(first, copy_urls[n - 2]), *history], args, args.timeout_s)
    log_turns(label, out)
    return out


def conversation_after_text(
    port: int, clip: Path, copies: list[Path], args, label: str
) -> dict[tuple[int, bool], Turn]:
    """ "hello" -> its answer -> [video, "now look at this video"]; the video turn again about
    copies[0] under a salt of its own (--video-after-text)."""
    hello, look = QUESTIONS_AFTER_TEXT
    out = {(1, False): ask(port, [user(hello)], args, args.timeout_s)}
    history = [user(hello), {"role": "assistant", "content": out[(1, False)].answer}]
    out[(2, False)] = ask(port, [*history, user(look, data_url(clip))], args, args.timeout_s)
    salt = f"bench-cold-{clip.stem}-{time.monotonic_ns()}"
    out[(2, True)] = ask(
        port, [*history, user(look, data_url(copies[0]))], args, args.timeout_s, cache_salt=salt
    )
    log_turns(label, out)
    return out


def log_turns(label: str, out: dict[tuple[int, bool], Turn]) -> None:
    line = "; ".join(
        f"turn {n}{' cold' if cold else ''} {t.ttft_ms:.0f} ms (prefill {t.prefill_ms:.0f}"
        + (
            f", cached {t.cached_tokens}/{t.prompt_tokens}"
            if t.cached_tokens is not None
            else f", {t.prompt_tokens} tok"
        )
        + ")"
        for (n, cold), t in out.items()
    )
    log(f"{label}: TTFT {line}")


# ---------------------------------------------------------------------------------------------
# report


def p50(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(results: list[dict[tuple[int, bool], Turn]], rows=ROWS) -> list[str]:
    """A row per (turn, cold) of `rows`, then the ratios cold / warm of each turn asked both ways."""
    lines = [f"{'':34} {'n':>3} {'TTFT p50 ms':>12} {'prefill p50 ms':>15} {'prompt tok':>11} "
             f"{'cached tok':>11} {'enc. hit':>9}"]  # fmt: skip
    for label, n, cold in rows:
        turns = [r[(n, cold)] for r in results]
        cached = [t.cached_tokens for t in turns if t.cached_tokens is not None]
        lines.append(
            f"{label:34} {len(turns):>3} {p50([t.ttft_ms for t in turns]):>12.1f} "
            f"{p50([t.prefill_ms for t in turns]):>15.1f} {p50([t.prompt_tokens for t in turns]):>11.0f} "
            f"{(f'{p50(cached):.0f}' if cached else 'n/a'):>11} "
            f"{sum(t.encoder_cache_hit for t in turns):>5}/{len(turns)}"
        )
    for n in sorted({n for _, n, cold in rows if cold}):
        warm = [r[(n, False)] for r in results]
        cold = [r[(n, True)] for r in results]
        ttft = p50([t.ttft_ms for t in cold]) / p50([t.ttft_ms for t in warm])
        prefill_warm = p50([t.prefill_ms for t in warm])
        prefill = p50([t.prefill_ms for t in cold]) / prefill_warm if prefill_warm > 0 else float("nan")
        what = "new cache_salt / prefix reused" if rows is ROWS_AFTER_TEXT else "cold / follow-up"
        lines.append(f"ratio {what}, turn {n}: TTFT {ttft:.2f}x, prefill {prefill:.2f}x")
    return lines


def mismatches(results: list[dict[tuple[int, bool], Turn]]) -> tuple[int, int]:
    pairs = [(r[(n, False)], r[(n, True)]) for r in results for (n, cold) in r if cold]
    return sum(a.token_ids != b.token_ids for a, b in pairs), len(pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-conversation"))
    p.add_argument("--model", default="", help="model directory (default: build the 27M Qwen2-VL)")
    p.add_argument("--num-clips", type=int, default=8, help="conversations (one clip each) measured")
    p.add_argument("--num-frames", type=int, default=64)
    p.add_argument("--clip-size", type=int, default=448, help="clip width = height, px")
    p.add_argument("--clip-seconds", type=float, default=8.0, help="clip length (8 fps)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--colocate", action="store_true", help="epd serve --colocate (one process)")
    p.add_argument("--threads", default="", help="epd serve --num-threads (default: epd's own)")
    p.add_argument(
        "--video-after-text",
        action="store_true",
        help='the conversation "hello" -> answer -> [video, question] instead (the video turn '
        "reuses the text turn's cached prefix), its video turn also under a new cache_salt",
    )
    p.add_argument(
        "--epd-arg", action="append", default=[], help="a flag passed on to epd serve (repeatable)"
    )
    p.add_argument("--timeout-s", type=float, default=900.0, help="start-up and per-request limit")
    p.add_argument("--output-json", default="", help="also write the per-request numbers here")
    args = p.parse_args(argv)

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model = Path(args.model)
    else:
        model = work / f"model-27m-{args.clip_size}px"
        if not model.exists():
            log(f"building the 27M Qwen2-VL (frames up to {args.clip_size}x{args.clip_size}) into {model}")
            build_model(model, args.clip_size * args.clip_size)
    clip_dir = work / f"clips-{args.clip_size}px-{args.clip_seconds:g}s"
    log(
        f"making {args.num_clips + 1} clips ({args.clip_size}x{args.clip_size}, {args.clip_seconds:g} s) and their copies"
    )
    clips = make_clips(clip_dir, args.num_clips + 1, args.clip_size, args.clip_seconds)
    copies = {
        c: [remux_copy(c, c.with_name(f"{c.stem}-copy{k}.mp4"), f"copy {k}") for k in (1, 2)] for c in clips
    }

    ports_file = work / "server.ports.json"
    cmd, env = server_command(model, args, ports_file)
    log_path = work / "server.log"
    log(f"starting {' '.join(cmd[3:5])} {'--colocate ' if args.colocate else ''}(log {log_path})")
    with open(log_path, "w") as log_file:
        proc = start_server(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    results: list[dict[tuple[int, bool], Turn]] = []
    try:
        launched = time.perf_counter()  # the stack names its ports once it is ready: count the wait
        http_port = bound_ports(ports_file, proc, args.timeout_s, log_path)["http"]
        log(
            f"serving after {time.perf_counter() - launched + wait_ready(proc, http_port, args.timeout_s, log_path):.1f} s; warm-up conversation"
        )
        warm_clip = clips[-1]
        converse = conversation_after_text if args.video_after_text else conversation
        converse(http_port, warm_clip, copies[warm_clip], args, "warm-up")
        for i, clip in enumerate(clips[:-1]):
            results.append(converse(http_port, clip, copies[clip], args, f"clip {i + 1}/{args.num_clips}"))
    finally:
        stop(proc)

    mode = "epd serve --colocate" if args.colocate else "epd serve"
    mode += "".join(f" {a}" for a in args.epd_arg)
    shape = " (video after a text-only turn)" if args.video_after_text else ""
    print(f"\n{mode}: {args.num_clips} conversations{shape}, {args.num_frames} frames at {args.clip_size}x{args.clip_size}, "
          f"{args.max_tokens} tokens per answer; model {model}")  # fmt: skip
    for line in table(results, ROWS_AFTER_TEXT if args.video_after_text else ROWS):
        print(line)
    bad, total = mismatches(results)
    pair = "prefix reused vs new cache_salt" if args.video_after_text else "follow-up vs asked cold"
    print(f"answer mismatches ({pair}): {bad} of {total}", flush=True)
    if args.output_json:
        rows = [{f"turn{n}{'_cold' if cold else ''}": vars(t) for (n, cold), t in r.items()} for r in results]
        Path(args.output_json).write_text(json.dumps({"command": cmd, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    run_bench(main)
