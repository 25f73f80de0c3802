"""The engine cores on a CUDA GPU: exact tokens from batched steps there, and what batching buys.

    PYTHONPATH=. python bench/cuda_check.py                       # on a machine with a CUDA GPU
    PYTHONPATH=. python bench/cuda_check.py --device cpu --quick  # the same checks on the CPU

Neither CI nor the tests need a GPU; this is the check a session that is lent one runs
(docs/benchmarks.md, "On a GPU"). Each part prints its own table; a part that fails prints its
traceback and the others still run (the exit code is 1 when any part failed or any token check
did not hold).

1. exactness, float32: the test suite's tiny Qwen2-VL and Qwen2.5-VL (with `--families all` also
   Qwen3-VL, its MoE, Qwen3.5, LLaVA-OneVision, GLM-4.1V and InternVL; built from the real config classes, saved,
   loaded back through from_pretrained), served by the embedded pipeline on the
   device: the colocated server's engine cores (batched tower steps, batched and chunked prefill,
   the decode batch over KV slots). Each case alone, then the four cases of
   tests/integration/test_exactness.py's batch at once (different prompt lengths, joins and leaves
   mid-batch); every request's tokens against `generate(do_sample=False)` of the unsplit model on
   the same device. A difference is shown with the reference's logit margin at that token: a
   near-tie (<= 1e-3) is rounding, anything else is an error.
2. bfloat16: the same batch in bf16 against generate() in bf16 (reported: bf16 rounding differs
   between a batched and a single matrix product, so a flip at a near-tie is expected there).
3. decode step time against batch size on the device: bench_decode_batch's KV slots against
   sequential steps, on bench_pruning's 27M model.
4. load: 32 requests a level (8 frames, 32 tokens, a different synthetic clip each) at 1 and 16
   in flight, through the embedded pipeline and through the stack (tests/stack.py's three model
   processes with `--device` and the gateway), and the Hugging Face generate() loop one request
   after another on the same device: requests/s, TTFT p50 and the ratios, in one run.
5. the three services as separate processes on the device (tests/stack.py: encoder, prefill and
   decode with `--device`, the gateway without a model), asked through the SDK: part 1's cases and
   batch over gRPC, with the KV cache crossing from the prefill process to the decode process.
6. token pruning on the device (CUDA only; skipped on another device): the "balanced" preset
   (temporal dropping before the tower, key tokens, spatial merge, prefill drop, KV compression,
   decode eviction) on the tiny Qwen2-VL, through part 1's embedded pipeline and part 5's stack.
   Every stage must run (a tensor left on the CPU raises a device mismatch) and report its counts;
   the tokens are compared with the same request on the CPU and reported (pruning is lossy and
   its choices follow the scores, so a near-tie may choose differently on the GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

# A checkout-only script: it makes its media with tests/media.py and its references with tests/reference.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import bench_decode_batch  # noqa: E402
from bench.bench_pruning import SPEC  # noqa: E402
from bench.common import make_clips  # noqa: E402
from epd.gateway.ask_types import AskRequest, AskSummary  # noqa: E402
from epd.gateway.embedded import build_embedded_pipeline  # noqa: E402
from epd.model_runtime.config import ModelConfig  # noqa: E402
from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model  # noqa: E402
from epd.model_runtime.loader import load_adapter  # noqa: E402
from epd.model_runtime.sampling import GenerationConfig  # noqa: E402
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint  # noqa: E402
from epd.stages.contracts import MediaInput, TokenStep  # noqa: E402
from epd.stages.messages import question_messages  # noqa: E402
from epd.video import simple_decoder  # noqa: E402
from epd.video.types import SamplingOptions  # noqa: E402
from tests.embedded import ask_tokens  # noqa: E402
from tests.families import FAMILIES, build_qwen3_vl_moe_checkpoint  # noqa: E402
from tests.media import make_video  # noqa: E402
from tests.reference import decode_for_test, divergence_margin, reference_tokens  # noqa: E402

QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 20
# Part 6: every stage of the preset, and decode eviction early enough to evict within 20 tokens.
PRUNING_PRESET = "balanced"
PRUNING_KNOBS = {"decode_min_steps": 4, "decode_evict_interval": 4}
PRUNING_STAGES = ["temporal", "spatial_merge", "prefill_drop", "kv_compress", "decode_evict"]
CASES = [("mp4", 8), ("mp4", 64), ("png", 1)]
# Parts 1 and 5 run the first two of FAMILIES (tests/families.py) unless --families names others
# ("all": every family epd serves).
# (media, frames, max_new_tokens, start delay s): tests/integration/test_exactness.py's batch.
BATCH = [("mp4", 64, 20, 0.0), ("mp4", 8, 7, 0.0), ("png", 1, 13, 0.05), ("mp4", 8, 20, 0.3)]
NEAR_TIE_LOGITS = 1e-3
FAILED: list[str] = []


def part(name: str):
    """Runs a part; a failure is printed and remembered, and the next part runs."""

    def wrap(fn):
        def run(*args, **kwargs):
            print(f"\n## {name}", flush=True)
            t0 = time.perf_counter()
            try:
                fn(*args, **kwargs)
            except Exception:
                traceback.print_exc()
                FAILED.append(name)
            print(f"({name}: {time.perf_counter() - t0:.1f} s)", flush=True)

        return run

    return wrap


def media_files(root: Path) -> dict[str, Path]:
    """tests/conftest.py's media: an 8 s H.264 clip at 10 fps and a PNG."""
    from PIL import Image

    files = {
        "mp4": make_video(root / "clip.mp4", codec="h264", size=(112, 84), fps=10.0, seconds=8.0, gop=20)
    }
    img = np.random.default_rng(3).integers(0, 256, size=(70, 90, 3), dtype=np.uint8)
    Image.fromarray(img).save(root / "image.png")
    files["png"] = root / "image.png"
    return files


def tiny(work: Path, family: str) -> Path:
    """The test suite's tiny checkpoint of `family` (built once per work dir)."""
    model_dir = work / family
    if not (model_dir / "config.json").exists():
        if family == "qwen3_vl_moe":
            build_qwen3_vl_moe_checkpoint(model_dir)
        else:
            build_checkpoint(model_dir, TinyVLMSpec(family=family))
    return model_dir


async def asks(pipeline, files, cases) -> list[list[int]]:
    """`cases` (media, frames, max_new_tokens, delay s) through `pipeline` at once: their tokens."""
    return list(
        await asyncio.gather(*(ask_tokens(pipeline, files[m], QUESTION, f, n, d) for m, f, n, d in cases))
    )


def check_tokens(label, model_dir, files, case, want, got, device, dtype) -> str:
    media, frames = case
    if got == want:
        return "equal"
    video = decode_for_test(files[media], frames)
    margin = divergence_margin(model_dir, video, QUESTION, want, got, device, dtype)
    assert margin is not None
    verdict = "near-tie" if margin[1] <= NEAR_TIE_LOGITS else "DIFFERS"
    if verdict == "DIFFERS" and dtype in (None, torch.float32):
        FAILED.append(f"{label}: {media} x {frames}")
    return f"{verdict} at token {margin[0]} (logit margin {margin[1]:.2e})"


def print_exactness_rows(family, model_dir, files, device, alone, batch) -> None:
    """One table row per case: `alone` {case: tokens}, `batch` the tokens of BATCH's requests,
    each against generate() of the unsplit model on `device` (float32)."""
    refs = {
        (m, f): reference_tokens(model_dir, decode_for_test(files[m], f), QUESTION, MAX_NEW_TOKENS, device)
        for m, f in CASES
    }
    in_batch: dict[tuple[str, int], list[str]] = {}
    for (m, f, max_new, _), got in zip(BATCH, batch, strict=True):
        in_batch.setdefault((m, f), []).append(
            f"{max_new} tokens: "
            + check_tokens(family, model_dir, files, (m, f), refs[(m, f)][:max_new], got, device, None)
        )
    for c in CASES:
        solo = check_tokens(family, model_dir, files, c, refs[c], alone[c], device, None)
        solo += f" ({len(refs[c])} tokens, {len(set(refs[c]))} distinct)"
        print(f"| {family} | {c[0]} x {c[1]} | {solo} | {'; '.join(in_batch.get(c, ['-']))} |", flush=True)


@part("1. exactness on the device, float32 (alone and in one batch) against generate()")
def exactness(work: Path, files, device: str, families: list[str]) -> None:
    print("| family | case | alone | in the batch |")
    print("|---|---|---|---|")
    for family in families:
        model_dir = tiny(work, family)
        pipeline = build_embedded_pipeline(ModelConfig(model=str(model_dir), device=device))

        async def run(pipeline=pipeline):
            alone = {c: (await asks(pipeline, files, [(*c, MAX_NEW_TOKENS, 0.0)]))[0] for c in CASES}
            return alone, await asks(pipeline, files, BATCH)

        alone, batch = asyncio.run(run())
        print_exactness_rows(family, model_dir, files, device, alone, batch)


@part(
    "5. the three services as processes on the device (gRPC, KV over the wire), float32, against generate()"
)
def services(work: Path, files, device: str, families: list[str]) -> None:
    """tests/stack.py's stack (encoder, prefill, decode with `--device`, and the gateway), asked
    through the SDK as test_exactness asks the CPU stack."""
    from epd.client import AsyncEpdClient
    from tests.stack import Stack

    async def ask_all(gateway: str):
        """Each case alone, then BATCH at once; one event loop for the whole part (grpc.aio binds
        to the first loop it runs on)."""

        async def one(client, media, frames, max_new, delay_s):
            await asyncio.sleep(delay_s)
            return await client.ask(files[media], QUESTION, num_frames=frames, max_new_tokens=max_new)

        async with AsyncEpdClient(gateway) as client:
            alone = {c: await one(client, *c, MAX_NEW_TOKENS, 0.0) for c in CASES}
            batch = await asyncio.gather(*(one(client, *case) for case in BATCH))
        return alone, [r.token_ids for r in batch]

    async def run() -> None:
        flags = ["--device", device]
        for family in families:
            model_dir = tiny(work, family)
            extra = {stage: flags for stage in ("encoder", "prefill", "decode")}
            with Stack(model_dir, work / f"logs-{family}", extra=extra) as stack:
                alone, batch = await ask_all(stack.gateway)
            if not all(r.kv_num_bytes > 0 for r in alone.values()):
                FAILED.append(f"services {family}: a KV cache of 0 bytes crossed prefill -> decode")
            tokens = {c: r.token_ids for c, r in alone.items()}
            print_exactness_rows(family, model_dir, files, device, tokens, batch)

    print("| family | case | alone | in the batch |")
    print("|---|---|---|---|")
    asyncio.run(run())


@part("2. bfloat16 on the device: the batch against generate() in bf16 (reported, rounding expected)")
def bfloat16(work: Path, files, device: str) -> None:
    model_dir = tiny(work, "qwen2_vl")
    print("| case | max new tokens | tokens equal before the first difference | at the first difference |")
    print("|---|---|---|---|")
    pipeline = build_embedded_pipeline(ModelConfig(model=str(model_dir), device=device, dtype="bfloat16"))
    batch = asyncio.run(asks(pipeline, files, BATCH))
    for (m, f, max_new, _), got in zip(BATCH, batch, strict=True):
        video = decode_for_test(files[m], f)
        want = reference_tokens(model_dir, video, QUESTION, max_new, device, torch.bfloat16)
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        note = check_tokens("bf16", model_dir, files, (m, f), want, got, device, torch.bfloat16)
        print(f"| {m} x {f} | {max_new} | {same}/{len(want)} | {note} |", flush=True)


@part("3. decode step time against batch size on the device (27M Qwen2-VL, float32)")
def step_times(work: Path, device: str, batches: list[int], steps: int) -> None:
    model_dir = work / "bench-27m"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, SPEC)
    adapter = load_adapter(ModelConfig(model=str(model_dir), device=device), "decode")
    caches = bench_decode_batch.prompt_caches(adapter, max(batches))
    bench_decode_batch.print_step_table(adapter, caches, batches, steps, device)


@part("6. token pruning on the device: the balanced preset, embedded and as processes (CUDA only)")
def pruning(work: Path, files, device: str) -> None:
    """main() runs it on CUDA only; `pruning(work, files, "cpu")` is its dry run."""
    from epd.client import EpdClient
    from epd.token_pruning import PruningConfig
    from tests.stack import Stack

    model_dir = tiny(work, "qwen2_vl")
    config = PruningConfig.from_preset(PRUNING_PRESET, **PRUNING_KNOBS)
    cases = [("mp4", 8), ("mp4", 64)]

    def embedded(on: str) -> dict[tuple[str, int], AskSummary]:
        pipeline = build_embedded_pipeline(ModelConfig(model=str(model_dir), device=on))

        async def one(media: str, frames: int) -> AskSummary:
            request = AskRequest(
                messages=question_messages(QUESTION),
                media=MediaInput(files[media].read_bytes()),
                sampling=SamplingOptions(num_frames=frames),
                generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
                pruning=config,
            )
            async for item in pipeline.ask(request):
                if isinstance(item, AskSummary):
                    return item
            raise RuntimeError("the pipeline ended without a summary")

        async def all_cases() -> dict[tuple[str, int], AskSummary]:  # one event loop per pipeline
            return {c: await one(*c) for c in cases}

        return asyncio.run(all_cases())

    def row(server: str, case, stages, tokens: list[int], cpu_tokens: list[int]) -> None:
        """stages: the summary's StageCounts (what each stage kept)."""
        names = [s.stage for s in stages]
        missing = [s for s in PRUNING_STAGES if s not in names]
        if missing:
            FAILED.append(f"pruning {server} {case[0]} x {case[1]}: stages {missing} did not run")
        counts = ", ".join(f"{s.stage} {s.num_visual_tokens_in}->{s.num_visual_tokens_out}" for s in stages)
        ran = "missing " + ", ".join(missing) if missing else "all ran"
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, cpu_tokens)) if a != b),
            min(len(tokens), len(cpu_tokens)),
        )
        same = "equal" if tokens == cpu_tokens else f"differ from token {first}"
        print(f"| {server} | {case[0]} x {case[1]} | {counts} | {ran} | {same} |", flush=True)

    cpu = embedded("cpu")
    print(f"preset {PRUNING_PRESET} with {PRUNING_KNOBS}, tiny Qwen2-VL, float32")
    print("| server | case | visual tokens per stage (in -> out) | stages | tokens against the CPU's |")
    print("|---|---|---|---|---|")
    for case, result in embedded(device).items():
        row("embedded", case, result.pruning.stages, result.token_ids, cpu[case].token_ids)

    extra = {stage: ["--device", device] for stage in ("encoder", "prefill", "decode")}
    with Stack(model_dir, work / "logs-pruning", extra=extra) as stack, EpdClient(stack.gateway) as client:
        for case in cases:
            answer = client.ask(
                files[case[0]],
                QUESTION,
                num_frames=case[1],
                max_new_tokens=MAX_NEW_TOKENS,
                pruning=PRUNING_PRESET,
                pruning_knobs=PRUNING_KNOBS,
            )
            row("stack (3 processes)", case, answer.pruning.stages, answer.token_ids, cpu[case].token_ids)


def summary(results: list[tuple[float, int]], wall_s: float) -> tuple[float, float, int]:
    """(req/s, TTFT p50 s, output tokens) of one level's (TTFT s, tokens) per request."""
    return len(results) / wall_s, statistics.median(r[0] for r in results), sum(r[1] for r in results)


def stack_levels(work, model_dir, device, warm, per_level, concurrency, max_tokens):
    """part 4's levels through tests/stack.py's three model processes and gateway, with the
    blocking SDK from one thread per request in flight (grpc.aio keeps to part 5's event loop)."""
    from concurrent.futures import ThreadPoolExecutor

    from epd.client import EpdClient, TokenDelta
    from tests.stack import Stack

    extra = {stage: ["--device", device] for stage in ("encoder", "prefill", "decode")}
    extra["gateway"] = ["--max-requests-per-client", str(max(concurrency, 8))]  # one client sends them all
    with Stack(model_dir, work / "logs-load", extra=extra) as stack, EpdClient(stack.gateway) as client:

        def one(path: Path) -> tuple[float, int]:
            t0, ttft, tokens = time.perf_counter(), 0.0, 0
            options = {"num_frames": 8, "max_new_tokens": max_tokens, "ignore_eos": True}
            for event in client.stream(path, "what moves?", **options):
                if isinstance(event, TokenDelta):
                    ttft = ttft or time.perf_counter() - t0
                    tokens += len(event.token_ids)
            return ttft, tokens

        def level(paths: list[Path], in_flight: int) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(in_flight) as pool:
                results = list(pool.map(one, paths))
            return summary(results, time.perf_counter() - t0)

        level(warm, 2)
        return {c: level(paths, c) for c, paths in zip((1, concurrency), per_level, strict=True)}


@part("4. load: requests/s at 1 and N in flight, and the generate() loop, on the device")
def load(work: Path, device: str, num_requests: int, concurrency: int, max_tokens: int) -> None:
    model_dir = work / "bench-27m"
    if not (model_dir / "config.json").exists():
        build_checkpoint(model_dir, SPEC)
    clips = make_clips(work / "clips", 4 * num_requests + 2, 224, 8.0)
    n = num_requests
    warm, embedded_clips, stack_clips = (
        clips[-2:],
        [clips[:n], clips[n : 2 * n]],
        [clips[2 * n : 3 * n], clips[3 * n : 4 * n]],
    )
    pipeline = build_embedded_pipeline(ModelConfig(model=str(model_dir), device=device))
    gen = GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True)

    async def one(path: Path, started: float) -> tuple[float, int]:
        request = AskRequest(
            messages=question_messages("what moves?"),
            media=MediaInput(path.read_bytes()),
            sampling=SamplingOptions(num_frames=8),
            generation=gen,
        )
        ttft, tokens = 0.0, 0
        async for item in pipeline.ask(request):
            if isinstance(item, TokenStep):
                ttft = ttft or time.perf_counter() - started
                tokens += len(item.token_ids)
        return ttft, tokens

    async def level(paths: list[Path], in_flight: int) -> tuple[float, float, int]:
        gate = asyncio.Semaphore(in_flight)

        async def gated(p: Path) -> tuple[float, int]:
            async with gate:
                return await one(p, time.perf_counter())

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in paths))
        return summary(results, time.perf_counter() - t0)

    async def levels() -> dict[int, tuple[float, float, int]]:
        await level(warm, 2)
        return {c: await level(paths, c) for c, paths in zip((1, concurrency), embedded_clips, strict=True)}

    ours = {"epd embedded": asyncio.run(levels())}
    ours["epd stack (3 processes)"] = stack_levels(
        work, model_dir, device, warm, stack_clips, concurrency, max_tokens
    )

    # The peer on the same device: the unsplit model, processor + generate(), one request at a time.
    model, processor = whole_model(model_dir, device)

    def hf_one(path: Path) -> None:
        video = simple_decoder.decode(path.read_bytes(), SamplingOptions(num_frames=8))
        inputs = reference_inputs(processor, video, question_message(video, "what moves?")).to(device)
        with torch.inference_mode():
            model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)

    for p in warm:
        hf_one(p)
    t0 = time.perf_counter()
    for p in embedded_clips[0]:
        hf_one(p)
    hf_rps = num_requests / (time.perf_counter() - t0)

    print(
        f"{num_requests} requests per level, 8 frames 224x224, {max_tokens} tokens each (ignore_eos / min_new_tokens)"
    )
    print("| server | in flight | req/s | vs generate() loop | TTFT p50 ms | output tok/s | wall s |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| generate() loop | 1 | {hf_rps:.2f} | 1.00x | - | {hf_rps * max_tokens:.0f} | {num_requests / hf_rps:.2f} |"
    )
    for (server, runs), c in ((x, c) for x in ours.items() for c in x[1]):
        rps, ttft, tokens = runs[c]
        print(
            f"| {server} | {c} | {rps:.2f} | {rps / hf_rps:.2f}x | {ttft * 1e3:.0f} | {rps * tokens / num_requests:.0f} | {num_requests / rps:.2f} |"
        )


def families_flag(text: str) -> list[str]:
    """--families: "all", or known family names, comma-separated (a usage error names them, not a
    traceback from building an unknown family's checkpoint in each part)."""
    if text == "all":
        return list(FAMILIES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in FAMILIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown families {unknown or [text]}: name some of {', '.join(FAMILIES)}, "
            "comma-separated, or all"
        )
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer requests and batch sizes (a CPU dry run)")
    ap.add_argument("--parts", default="1,2,3,4,5,6", help="which parts to run, e.g. 1,3 (6 needs CUDA)")
    ap.add_argument(
        "--families",
        type=families_flag,
        default=FAMILIES[:2],
        help=f"parts 1 and 5's model families, comma-separated, or 'all' ({', '.join(FAMILIES)})",
    )
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    families = args.families
    if args.device.startswith("cuda"):
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(args.device)}")
    import transformers

    print(f"transformers {transformers.__version__}, device {args.device}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="epd-cuda-check-"))
    work.mkdir(parents=True, exist_ok=True)
    files = media_files(work)
    if 1 in parts:
        exactness(work, files, args.device, families)
    if 2 in parts:
        bfloat16(work, files, args.device)
    if 3 in parts:
        step_times(work, args.device, [1, 4] if args.quick else [1, 4, 16, 32, 64], 8 if args.quick else 32)
    if 5 in parts:
        services(work, files, args.device, families)
    if 4 in parts:
        load(work, args.device, 4 if args.quick else 32, 2 if args.quick else 16, 8 if args.quick else 32)
    if 6 in parts and args.device.startswith("cuda"):  # another device: parts 1-5 only, as before
        pruning(work, files, args.device)
    print(f"\nfailed: {', '.join(FAILED)}" if FAILED else "\nevery part ran; every float32 token check held")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
