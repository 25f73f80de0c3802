"""Time from video bytes to visual tokens: decode then encode, overlapped, and a cache hit.

    PYTHONPATH=. python bench/bench_encode.py                       # 720p 30 s, 32 frames
    PYTHONPATH=. python bench/bench_encode.py --height 1080 --seconds 60 --frames 64

In one run, on the same video and model (a Qwen2-VL vision tower of `--vision-depth` blocks of
width `--vision-width`, randomly initialised; frames downscaled to --max-pixels):
  decode        the parallel decoder alone (frames only)
  encode        preprocessing + vision tower on those frames, whole sample at once
  sequential    EncoderEngine with frames_per_group=0: decode everything, then encode
  overlapped    EncoderEngine with frames_per_group=N: encode each group while later ones decode
  cache hit     the same request again: no decode, no encode
Prints medians and the ratios the issue asks for: overlapped / max(decode, encode) (target
<= 1.15), sequential / overlapped, and miss / hit (target >= 20x for 64 frames).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

# Checkout-only scripts: they make their clips with tests/media.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.encoder_svc.config import EncoderConfig  # noqa: E402
from epd.encoder_svc.engine import EncoderEngine  # noqa: E402
from epd.encoder_svc.token_cache import TokenCacheConfig  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint  # noqa: E402
from epd.stages.contracts import MediaInput  # noqa: E402
from epd.video.parallel_decode_config import ParallelDecodeConfig  # noqa: E402
from epd.video.parallel_decoder import ParallelDecoder  # noqa: E402
from epd.video.types import DecodeLimits, SamplingOptions  # noqa: E402
from tests.media import make_video  # noqa: E402


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def add_encode_args(p: argparse.ArgumentParser) -> None:
    """The video, tower and decode options this bench and bench_shared_encode.py share."""
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--gop-s", type=float, default=2.0)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--frames-per-group", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-pixels", type=int, default=448 * 448)
    p.add_argument("--vision-depth", type=int, default=8)
    p.add_argument("--vision-width", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the encoder")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "epd-bench"))


def encode_setup(args: argparse.Namespace):
    """(encoder-stage adapter, the video's bytes, its SamplingOptions) for `add_encode_args`'s
    options: the clip and the tiny tower made once under --cache-dir, then reused."""
    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    width = args.height * 16 // 9 // 2 * 2
    video_path = cache / f"enc_{args.height}p_{args.seconds:g}s_gop{args.gop_s:g}.mp4"
    if not video_path.exists():
        print(f"generating {video_path.name} ...", file=sys.stderr)
        make_video(
            video_path,
            codec="h264",
            size=(width, args.height),
            fps=30.0,
            seconds=args.seconds,
            gop=int(30 * args.gop_s),
            pattern="noise",
            single_slice=True,
        )
    spec = TinyVLMSpec(
        vision_depth=args.vision_depth,
        vision_embed_dim=args.vision_width,
        vision_num_heads=4,
        max_pixels=args.max_pixels,
        min_pixels=56 * 56,
    )
    model_dir = cache / f"model_d{args.vision_depth}_w{args.vision_width}_p{args.max_pixels}"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, spec)
    adapter = load_adapter(ModelConfig(model=str(model_dir), num_threads=args.threads), "encoder")
    data = video_path.read_bytes()
    sampling = SamplingOptions(num_frames=args.frames, max_pixels=args.max_pixels)
    return adapter, data, sampling


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_encode_args(p)
    args = p.parse_args(argv)
    adapter, data, sampling = encode_setup(args)
    decode_cfg = ParallelDecodeConfig(num_workers=args.workers)
    no_cache = TokenCacheConfig(memory_budget_bytes=0)

    decoder = ParallelDecoder(decode_cfg)
    frames = decoder.decode(data, sampling, DecodeLimits())
    t_decode = median_s(lambda: decoder.decode(data, sampling, DecodeLimits()), args.repeats)
    decoder.close()
    t_encode = median_s(lambda: adapter.encode(adapter.preprocess(frames)), args.repeats)

    def engine_time(frames_per_group: int) -> float:
        engine = EncoderEngine(
            EncoderConfig(decode=decode_cfg, frames_per_group=frames_per_group, cache=no_cache), adapter
        )
        try:
            return median_s(lambda: engine.encode(MediaInput(data), sampling, lambda e: None), args.repeats)
        finally:
            engine.close()

    t_sequential = engine_time(0)
    t_overlapped = engine_time(args.frames_per_group)

    engine = EncoderEngine(EncoderConfig(decode=decode_cfg, frames_per_group=args.frames_per_group), adapter)
    t0 = time.perf_counter()
    engine.encode(MediaInput(data), sampling, lambda e: None)
    t_miss = time.perf_counter() - t0
    t_hit = median_s(lambda: engine.encode(MediaInput(data), sampling, lambda e: None), args.repeats)
    engine.close()

    floor = max(t_decode, t_encode)
    print(
        f"video {args.height}p {args.seconds:g} s, keyframe every {args.gop_s:g} s, {args.frames} frames, "
        f"{args.workers} decode workers, {args.threads} torch thread(s), vision tower depth "
        f"{args.vision_depth} width {args.vision_width}, frames at <= {args.max_pixels} px, "
        f"medians of {args.repeats}"
    )
    print("| step | seconds |")
    print("|---|---|")
    for name, t in [
        ("decode", t_decode),
        ("encode", t_encode),
        ("sequential decode+encode", t_sequential),
        (f"overlapped (groups of {args.frames_per_group})", t_overlapped),
        ("cache miss (first request)", t_miss),
        ("cache hit", t_hit),
    ]:
        print(f"| {name} | {t:.3f} |")
    print(f"overlapped / max(decode, encode) = {t_overlapped / floor:.2f} (target <= 1.15)")
    print(f"sequential / overlapped = {t_sequential / t_overlapped:.2f}x")
    print(f"cache miss / hit = {t_miss / t_hit:.0f}x (target >= 20x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
