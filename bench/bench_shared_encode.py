"""What a request waiting on another's encode of the same video waits, when that other request (the
work's leader) is cancelled half-way through its decode (`encoder_svc/single_flight.py`):

    PYTHONPATH=. python bench/bench_shared_encode.py                  # 720p 30 s, 32 frames
    PYTHONPATH=. python bench/bench_shared_encode.py --frames 64 --repeats 5

In one run, on the same video and model (a Qwen2-VL vision tower of `--vision-depth` blocks,
randomly initialised), token cache off, each repeat: the leader starts the encode, the second
request joins it, and the leader's caller leaves once half of the frames are encoded. Two ways:
  restart   the behaviour before: the work is cancelled with its leader, and the waiting request
            takes it over, decoding and encoding the video again from its first frame (reproduced
            here by cancelling the work's flag with the leader's);
  handover  now: the work goes on for the waiting request.
Prints the medians of the second request's latency (from its arrival, and from the leader's
leaving), their ratio restart / handover, and how many decodes each way ran.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

# Checkout-only scripts: they make their clips with tests/media.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.bench.bench_encode import add_encode_args, encode_setup  # noqa: E402
from epd.encoder_svc.config import EncoderConfig  # noqa: E402
from epd.encoder_svc.engine import EncoderEngine  # noqa: E402
from epd.encoder_svc.single_flight import Interest  # noqa: E402
from epd.encoder_svc.token_cache import TokenCacheConfig  # noqa: E402
from epd.stages.contracts import MediaInput, RequestCancelled, StageEvent  # noqa: E402
from epd.video.parallel_decode_config import ParallelDecodeConfig  # noqa: E402
from epd.video.types import SamplingOptions  # noqa: E402


def one_round(engine: EncoderEngine, data: bytes, sampling: SamplingOptions, frames: int, restart: bool):
    """(second request's latency from its arrival, from the leader's leaving, decodes run)."""
    key = engine.cache_key(hashlib.sha256(data).hexdigest(), sampling)
    started, half = threading.Event(), threading.Event()
    decodes = []

    def leader_events(event: StageEvent) -> None:
        if event.stage == "video_decode" and event.state == "started":
            decodes.append(1)
            started.set()
        if event.state == "progress" and int(event.details.get("frames_done", 0)) >= frames // 2:
            half.set()

    leader = Interest()

    def lead() -> None:
        try:
            engine.encode(MediaInput(data), sampling, leader_events, interest=leader)
        except RequestCancelled:
            pass

    leading = threading.Thread(target=lead)
    leading.start()
    started.wait()
    waiter_out: list[float] = []

    def waiter_events(event: StageEvent) -> None:
        if event.stage == "video_decode" and event.state == "started":
            decodes.append(1)

    def wait() -> None:
        t0 = time.perf_counter()
        engine.encode(MediaInput(data), sampling, waiter_events, interest=Interest())
        waiter_out.append(time.perf_counter() - t0)

    arrived = time.perf_counter()
    waiting = threading.Thread(target=wait)
    waiting.start()
    while engine.flights.num_waiting(key) == 0:
        time.sleep(0.001)
    half.wait()
    flight = engine.flights._flights[key]  # the leader's work (private: only "restart" needs it)
    left = time.perf_counter()
    leader.leave()
    if restart:
        flight.cancel.set()  # before: the work went with its leader
    waiting.join()
    leading.join()
    done = time.perf_counter()
    assert waiter_out, "the second request failed"
    return done - arrived, done - left, len(decodes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_encode_args(p)
    args = p.parse_args(argv)
    adapter, data, sampling = encode_setup(args)
    engine = EncoderEngine(
        EncoderConfig(
            decode=ParallelDecodeConfig(num_workers=args.workers),
            frames_per_group=args.frames_per_group,
            cache=TokenCacheConfig(memory_budget_bytes=0),
        ),
        adapter,
    )
    results: dict[str, list[tuple[float, float, int]]] = {"restart": [], "handover": []}
    try:
        engine.encode(MediaInput(data), sampling, lambda e: None)  # warm: keyframe index, allocator
        for _ in range(args.repeats):  # interleaved: both ways see the same machine
            for way in results:
                results[way].append(one_round(engine, data, sampling, args.frames, way == "restart"))
    finally:
        engine.close()
    print(
        f"video {args.height}p {args.seconds:g} s, keyframe every {args.gop_s:g} s, {args.frames} frames "
        f"in groups of {args.frames_per_group}, {args.workers} decode workers, {args.threads} torch "
        f"thread(s), vision tower depth {args.vision_depth} width {args.vision_width}, token cache off, "
        f"leader leaves at half of the frames; medians of {args.repeats}"
    )
    medians = {}
    for way, rows in results.items():
        arrival = statistics.median(r[0] for r in rows)
        after_leave = statistics.median(r[1] for r in rows)
        medians[way] = arrival
        print(
            f"  {way:9s} second request {arrival * 1e3:8.1f} ms from its arrival, "
            f"{after_leave * 1e3:8.1f} ms after the leader left; decodes per round {rows[0][2]}"
        )
    print(f"  restart / handover (second request's latency): {medians['restart'] / medians['handover']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
