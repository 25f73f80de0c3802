"""Cost of visual tokens: encode, prefill, per-token decode and KV bytes at several retention levels.

    PYTHONPATH=. python bench/bench_pruning.py                      # 8, 32, 64 frames
    PYTHONPATH=. python bench/bench_pruning.py --frames 8 --repeats 1
    PYTHONPATH=. python bench/bench_pruning.py --drop-layers 0 2     # staged drop at layers 0 and 2
    PYTHONPATH=. python bench/bench_pruning.py --kv-keep 0.5         # + LOOK-M on the survivors
    PYTHONPATH=. python bench/bench_pruning.py --kv-dtype bfloat16   # + KV kept and sent in bf16

A ~30M-parameter Qwen2-VL (8 layers of width 512, GQA 8/2 heads; 4-block vision tower), built
from the real config class and randomly initialised, on a generated H.264 clip. For each frame
count, in one process:
  * retention r in {100%, 50%, 25%, 10%} of the visual tokens, kept by prefill-stage dropping at
    layer 1 (or the --drop-layers stages; MustDrop's dual rule on the question's attention); the KV
    cache sent to Decode then holds text + r * visual entries (times --kv-keep when KV compression
    runs on top);
  * prefill ms and per-token decode ms (median of --decode-tokens steps), KV bytes;
  * encode ms with the encode stage off and with temporal dropping before the tower (the clip
    has a static background, so temporal dropping removes what does not change);
  * each --presets preset (default: light, budget25) end to end, the encoder's stages included.
Every ratio is against the unpruned run measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402

from epd.decode_svc.engine import DecodeEngine  # noqa: E402
from epd.encoder_svc.config import EncoderConfig  # noqa: E402
from epd.encoder_svc.engine import EncoderEngine  # noqa: E402
from epd.encoder_svc.token_cache import TokenCacheConfig  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig  # noqa: E402
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint  # noqa: E402
from epd.prefill_svc.config import PrefillConfig  # noqa: E402
from epd.prefill_svc.engine import PrefillEngine  # noqa: E402
from epd.prefill_svc.whole_prefill import prefill_alone  # noqa: E402
from epd.stages.contracts import MediaInput  # noqa: E402
from epd.stages.messages import question_messages  # noqa: E402
from epd.token_pruning import PruningConfig  # noqa: E402
from epd.video.types import SamplingOptions  # noqa: E402

SPEC = TinyVLMSpec(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    vision_depth=4,
    vision_embed_dim=256,
    vision_num_heads=4,
    min_pixels=56 * 56,
    max_pixels=224 * 224,
    weight_std=0.02,
)


QUESTION = question_messages("what colour is the moving square?")
"""The one question every run asks about its clip (a user message: the clip, then the text)."""

TEMPORAL = PruningConfig(temporal_drop=True, temporal_threshold=0.05)


def make_clip(path: Path, seconds: float = 8.0, fps: int = 10, size=(224, 224)) -> None:
    """A static textured background with one moving square (real H.264)."""
    import av

    rng = np.random.default_rng(0)
    background = rng.integers(0, 256, size=(size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
    background = background.repeat(8, 0).repeat(8, 1)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps, options={"qp": "10"})
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(int(seconds * fps)):
            frame = background.copy()
            x = (i * 4) % (size[0] - 40)
            frame[80:120, x : x + 40] = (255, 40, 40)
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--retain", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--drop-layers",
        type=int,
        nargs="+",
        default=[1],
        help="decoder layers that drop visual tokens (several: a staged drop)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16"],
        help="dtype the pruned runs keep and send the KV cache in",
    )
    p.add_argument(
        "--presets",
        nargs="*",
        default=["light", "budget25"],
        help="also run these presets end to end (encoder stages included)",
    )
    p.add_argument(
        "--kv-keep",
        type=float,
        default=1.0,
        help="also compress the survivors' KV entries to this fraction (LOOK-M, averaged merge)",
    )
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "epd-bench-pruning"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, SPEC)
    clip = work / "clip.mp4"
    if not clip.exists():
        make_clip(clip)
    model = ModelConfig(model=str(model_dir), num_threads=args.threads)
    adapter = load_adapter(model, "all")
    params = adapter.num_parameters
    encoder = EncoderEngine(
        EncoderConfig(model=model, cache=TokenCacheConfig(memory_budget_bytes=0)), adapter
    )
    prefill = PrefillEngine(PrefillConfig(model=model), adapter)
    decoder = DecodeEngine(adapter)
    try:  # the encoder's decode threads end with it
        data = clip.read_bytes()
        gen = GenerationConfig(max_new_tokens=args.decode_tokens + 1, ignore_eos=True)
        print(
            f"model: Qwen2-VL, {params / 1e6:.1f}M parameters, {args.threads} thread(s); clip 8 s 224x224; "
            f"medians of {args.repeats}; drop at layers {args.drop_layers}; KV keep {args.kv_keep:g}; "
            f"KV dtype {args.kv_dtype}"
        )
        print(
            "| frames | visual tokens | retained | encode ms | prefill ms (x faster) | decode ms/token (x) | "
            "KV bytes (x smaller) |"
        )
        print("|---|---|---|---|---|---|---|")
        for num_frames in args.frames:
            sampling = SamplingOptions(num_frames=num_frames)

            def encode(pruning: PruningConfig, sampling: SamplingOptions = sampling):
                return encoder.encode(MediaInput(data), sampling, lambda e: None, pruning)

            enc_full = [timed(lambda: encode(PruningConfig())) for _ in range(args.repeats)]
            media, _ = enc_full[0]
            encode_ms = statistics.median(t for _, t in enc_full)
            enc_t = [timed(lambda: encode(TEMPORAL)) for _ in range(args.repeats)]
            temporal_media, _ = enc_t[0]
            encode_t_ms = statistics.median(t for _, t in enc_t)
            kept_t = temporal_media.meta.num_visual_tokens / media.meta.num_visual_tokens
            base = None
            for r in args.retain:
                cfg = (
                    PruningConfig()
                    if r >= 1.0
                    else PruningConfig(
                        prefill_drop=True,
                        prefill_drop_layers=tuple(args.drop_layers),
                        prefill_keep_ratio=r,
                        kv_compress=args.kv_keep < 1.0,
                        kv_keep_ratio=args.kv_keep,
                        kv_dtype=args.kv_dtype,
                    )
                )

                def run_prefill(cfg: PruningConfig = cfg, media=media):
                    return prefill_alone(prefill, QUESTION, media, gen, cfg)

                runs = [timed(run_prefill) for _ in range(args.repeats)]
                outcome = runs[0][0]
                prefill_ms = statistics.median(t for _, t in runs)
                g = decoder.start(
                    outcome.cache, outcome.handle.first_token_id, outcome.handle.next_position_ids, gen
                )
                step_ms = []
                while not g.done:
                    _, ms = timed(g.step)
                    step_ms.append(ms)
                decode_ms = statistics.median(step_ms)
                kv = outcome.cache.num_bytes
                if base is None:
                    base = (prefill_ms, decode_ms, kv)
                enc = f"{encode_ms:.0f}" if r >= 1.0 else "-"
                print(
                    f"| {num_frames} | {media.meta.num_visual_tokens} | {r:.0%} | {enc} | {prefill_ms:.0f} "
                    f"({base[0] / prefill_ms:.2f}x) | {decode_ms:.1f} ({base[1] / decode_ms:.2f}x) | "
                    f"{kv:,} ({base[2] / kv:.2f}x) |"
                )
            print(
                f"| {num_frames} | temporal drop before tower | {kept_t:.0%} kept | {encode_t_ms:.0f} "
                f"({encode_ms / encode_t_ms:.2f}x faster) | | | |"
            )
            for preset in args.presets:
                # Every stage of the preset: the encoder's drops first, then prefill, KV and decode.
                cfg = PruningConfig.from_preset(preset)
                enc_p = [timed(lambda cfg=cfg: encode(cfg)) for _ in range(args.repeats)]
                pmedia, _ = enc_p[0]

                def run_preset(cfg: PruningConfig = cfg, pmedia=pmedia):
                    return prefill_alone(prefill, QUESTION, pmedia, gen, cfg)

                runs = [timed(run_preset) for _ in range(args.repeats)]
                outcome = runs[0][0]
                prefill_ms = statistics.median(t for _, t in runs)
                g = decoder.start(
                    outcome.cache,
                    outcome.handle.first_token_id,
                    outcome.handle.next_position_ids,
                    gen,
                    visual_entry_mask=outcome.handle.visual_entry_mask,
                    pruning=cfg,
                )
                step_ms = []
                while not g.done:
                    _, ms = timed(g.step)
                    step_ms.append(ms)
                # after the last stage
                kept = outcome.handle.pruning.num_visual_tokens_out / media.meta.num_visual_tokens
                enc_ms = statistics.median(t for _, t in enc_p)
                kv = outcome.cache.num_bytes
                assert base is not None
                print(
                    f"| {num_frames} | preset {preset} | {kept:.1%} | {enc_ms:.0f} | {prefill_ms:.0f} "
                    f"({base[0] / prefill_ms:.2f}x) | {statistics.median(step_ms):.1f} "
                    f"({base[1] / statistics.median(step_ms):.2f}x) | {kv:,} ({base[2] / kv:.2f}x) |"
                )
    finally:
        encoder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
