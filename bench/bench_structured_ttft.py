"""What compiling a structured output while the media is encoded saves the time to the first token:
requests about a video with a spec that compiles slowly, each spec and media new (a suffix of its
own; a tenant of its own, so the encoder's token cache and prefill's prefix cache miss), through
the embedded pipeline (the same `Pipeline` the gateway runs) as it is (the spec compiles during
the encode, `PrefillStage.compile_structured_outputs`) and as it was (compiled by prefill, after
the encode: the stage behind `CompileAtPrefill`), in turns each round, the median of `--rounds`.

    PYTHONPATH=. python bench/bench_structured_ttft.py
    PYTHONPATH=. python bench/bench_structured_ttft.py --regex-repeats 3000 --rounds 5

The model is bench_pruning's ~30M-parameter Qwen2-VL given Qwen2-VL's 151,936-token vocabulary,
against which xgrammar compiles the regex `[a-z]*` repeated 2500 times in about a second on a
2-core VM (2000: 0.6 s; 3000: 1.8 s).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_pruning import SPEC  # noqa: E402
from epd.gateway.ask_types import AskRequest, AskSummary  # noqa: E402
from epd.gateway.embedded import build_embedded_pipeline  # noqa: E402
from epd.gateway.pipeline import Pipeline  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs  # noqa: E402
from epd.model_runtime.tiny_model import build_checkpoint  # noqa: E402
from epd.stages.contracts import EncodedMedia, MediaInput, PrefillHandle, PrefillStage  # noqa: E402
from epd.stages.messages import Message, question_messages  # noqa: E402
from epd.stages.names import TTFT, Stage  # noqa: E402
from epd.video.types import SamplingOptions  # noqa: E402
from tests.embedded import request_summary  # noqa: E402
from tests.media import make_video  # noqa: E402

QWEN_VOCAB = 151_936


class CompileAtPrefill(PrefillStage):
    """`stage` as prefill was before the spec compiled during the encode: it compiles nothing
    early (`PrefillStage`'s default), so its prefill compiles the spec, after the encode."""

    def __init__(self, stage: PrefillStage) -> None:
        self.stage = stage

    async def prefill(
        self, messages: Sequence[Message], media: EncodedMedia | None, *args, **kwargs
    ) -> PrefillHandle:
        return await self.stage.prefill(messages, media, *args, **kwargs)

    async def release(self, handle: PrefillHandle, request_id: str) -> None:
        await self.stage.release(handle, request_id)


async def ask(
    pipeline: Pipeline, video: bytes, spec: StructuredOutputs | None, num_frames: int
) -> AskSummary:
    request = AskRequest(
        messages=question_messages("describe the video"),
        media=MediaInput(video),
        sampling=SamplingOptions(num_frames=num_frames),
        generation=GenerationConfig(max_new_tokens=1, structured_outputs=spec),
        cache_salt=uuid.uuid4().hex,  # the media new to the encoder's cache and prefill's
    )
    return await request_summary(pipeline, request)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--regex-repeats", type=int, default=2500, help="times `[a-z]*` repeats in the spec")
    parser.add_argument("--num-frames", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/epd-bench-structured-ttft"))
    args = parser.parse_args()
    model_dir = args.work_dir / "model"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, replace(SPEC, vocab_size=QWEN_VOCAB))
    video_path = args.work_dir / "clip.mp4"
    if not video_path.exists():
        make_video(video_path, size=(320, 240), fps=10.0, seconds=10.0, gop=100, pattern="texture")
    video = video_path.read_bytes()
    torch.set_num_threads(args.threads)
    pipeline = build_embedded_pipeline(ModelConfig(model=str(model_dir), num_threads=args.threads))
    paths = {
        "compiled during the encode (now)": pipeline,
        "compiled by prefill after it (before)": Pipeline(
            pipeline.encoder, CompileAtPrefill(pipeline.prefill), pipeline.decoder
        ),
    }

    def spec() -> StructuredOutputs:
        return StructuredOutputs(regex="[a-z]*" * args.regex_repeats + f" {uuid.uuid4().hex[:8]}")

    async def run() -> dict[str, dict[str, list[float]]]:
        await ask(pipeline, video, spec(), args.num_frames)  # untimed: the vocabulary read, allocations
        times: dict[str, dict[str, list[float]]] = {name: {} for name in [*paths, "no spec"]}
        for _ in range(args.rounds):
            for name, path in [*paths.items(), ("no spec", pipeline)]:
                summary = await ask(path, video, None if name == "no spec" else spec(), args.num_frames)
                for key in (TTFT, Stage.VIDEO_DECODE.value, Stage.ENCODE.value, Stage.PREFILL.value):
                    times[name].setdefault(key, []).append(summary.timings_ms[key])
        return times

    with pipeline:
        times = asyncio.run(run())
    print(
        f"TTFT of a {args.num_frames}-frame question, regex `[a-z]*` x {args.regex_repeats} (a new spec each), "
        f"vocab {QWEN_VOCAB:,}, {args.threads} thread(s), median of {args.rounds} rounds (ms)"
    )
    print(f"   {'':40s} {'ttft':>8s} {'decode':>8s} {'encode':>8s} {'prefill':>8s}")
    for name, by_key in times.items():
        cells = " ".join(f"{statistics.median(v):8.0f}" for v in by_key.values())
        print(f"   {name:40s} {cells}")


if __name__ == "__main__":
    main()
