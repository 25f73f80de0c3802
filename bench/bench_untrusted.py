"""What the untrusted-media controls bound, measured against the unbounded work they prevent.

    PYTHONPATH=. python bench/bench_untrusted.py

In one run:
  repeated frames   a one-frame 1080p H.264 file asked for 256 frames, decoded by the parallel
                    decoder in the encoder's groups of 2: traced peak memory (numpy and FFmpeg
                    frames copied into numpy; tracemalloc) against the 256 x 1920 x 1080 x 3 bytes
                    a decoder that materialises every slot needs.
  packet flood      a Matroska file of many 16x16 packets: time to the refusal with
                    --max-demux-s against the time to demux the whole file without the limit.
Prints a markdown table with ratios (higher = more work prevented).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

# Checkout-only scripts: they make their clips with tests/media.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.video.keyframe_index import build_video_index  # noqa: E402
from epd.video.parallel_decode_config import ParallelDecodeConfig  # noqa: E402
from epd.video.parallel_decoder import ParallelDecoder  # noqa: E402
from epd.video.types import DecodeLimits, MediaLimitError, SamplingOptions  # noqa: E402
from tests.media import make_packet_flood, make_video  # noqa: E402


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def repeated_frames(tmp: Path) -> str:
    data = make_video(tmp / "one.mp4", size=(1920, 1080), fps=1.0, seconds=1.0, gop=1).read_bytes()
    decoder = ParallelDecoder(ParallelDecodeConfig(num_workers=2))
    try:
        tracemalloc.start()
        with decoder.iter_groups(data, SamplingOptions(num_frames=256), group_size=2) as stream:
            num_groups = sum(1 for _ in stream)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        decoder.close()
    materialised = 256 * 1920 * 1080 * 3
    return (
        f"| repeated frames: 1 x 1080p frame, 256 asked ({num_groups} groups of 2) | "
        f"peak {peak / 2**20:.0f} MiB | {materialised / 2**20:.0f} MiB materialised | "
        f"{materialised / peak:.0f}x less memory |"
    )


def packet_flood(num_packets: int, limit_s: float, repeats: int) -> str:
    data = make_packet_flood(num_packets)
    unbounded = DecodeLimits(max_demux_s=1e9)
    bounded = DecodeLimits(max_demux_s=limit_s)
    full_s = median_s(lambda: build_video_index(data, unbounded), repeats)

    def refused() -> None:
        try:
            build_video_index(data, bounded)
        except MediaLimitError:
            return
        raise SystemExit(
            f"the flood of {num_packets:,} packets was demuxed within {limit_s:g} s, so "
            "nothing was refused: raise --flood-packets or lower --flood-limit-s"
        )

    refused_s = median_s(refused, repeats)
    return (
        f"| packet flood: {num_packets:,} packets ({len(data) / 2**20:.1f} MiB), --max-demux-s {limit_s:g} | "
        f"refused in {refused_s:.2f} s | whole demux {full_s:.2f} s | {full_s / refused_s:.1f}x less time |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flood-packets", type=int, default=400_000)
    parser.add_argument("--flood-limit-s", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, repeats={args.repeats}")
    print("| case | bounded | unbounded | ratio |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        print(repeated_frames(Path(tmp)), flush=True)
        print(packet_flood(args.flood_packets, args.flood_limit_s, args.repeats), flush=True)


if __name__ == "__main__":
    main()
