"""`epd bench quality`: accuracy on the synthetic test split, through the serving path.

    PYTHONPATH=. python -m epd.bench.quality \
        --presets off,light,budget25,balanced,aggressive --out bench_results/quality

Every question of the test split goes through `epd.gateway.embedded.build_embedded_pipeline` (the
embedded Encode -> Prefill -> Decode pipeline `epd ask` runs: the same decoder, frame sampling,
preprocessing, prompt, prefill and decode as the services), greedy, and the answer counts as
correct when it equals the one-word label exactly (after stripping spaces and lowercasing).

For each token-dropping / KV-compression preset (`token_pruning.PruningConfig.from_preset`) and
each fixed retention setting (`keep50`, `keep25`, `keep10`: the prefill drop alone, staged at
layers 0 and 1, keeping that share of the visual tokens; `keep25-kvbf16`: plus a bfloat16 KV
cache) it reports accuracy overall and per question type and the visual tokens kept, and writes
    <out>/quality.csv          one row per (preset, question type), plus "overall" per preset
    <out>/quality_answers.csv  one row per (preset, question): expected and generated answer
    <out>/quality.json         the same numbers and the settings of the run
    <out>/quality.png          accuracy against mean retained visual tokens, one point per preset
Presets run only when the pipeline takes a pruning option (`AskRequest.pruning`); until then
the bench runs "off" and says which presets it skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from epd.cmdline.flexible import add_config_flag, parse_flexibly
from epd.cmdline.keyword_help import add_keyword_help

PRESET_NAMES: tuple[str, ...] = ("off", "light", "budget25", "balanced", "aggressive")
# Fixed retention levels (issue #4's benchmark settings, as `bench/bench_pruning.py --drop-layers 0 1`
# runs them): only the prefill drop, staged at layers 0 and 1, keeping this share of the visual
# tokens; "-kvbf16" also keeps and sends the KV cache in bfloat16.
_STAGED = {"prefill_drop": True, "prefill_drop_layers": (0, 1)}
RETENTION_SETTINGS: dict[str, dict] = {
    "keep50": {**_STAGED, "prefill_keep_ratio": 0.5},
    "keep25": {**_STAGED, "prefill_keep_ratio": 0.25},
    "keep10": {**_STAGED, "prefill_keep_ratio": 0.1},
    "keep25-kvbf16": {**_STAGED, "prefill_keep_ratio": 0.25, "kv_dtype": "bfloat16"},
}
# The encoder stages Qwen3-VL supports (temporal drop + key tokens; it refuses the spatial merge
# and every prefill / KV / decode stage): the encoder stages of light, balanced and aggressive
# without the spatial merge. Not run by default; `--presets off,temporal03-keys05,...`.
ENCODER_ONLY_SETTINGS: dict[str, dict] = {
    "temporal03-keys05": {"temporal_drop": True, "temporal_threshold": 0.03, "key_token_ratio": 0.05},
    "temporal05-keys05": {"temporal_drop": True, "temporal_threshold": 0.05, "key_token_ratio": 0.05},
    "temporal08-keys03": {"temporal_drop": True, "temporal_threshold": 0.08, "key_token_ratio": 0.03},
}
DEFAULT_PRESETS: tuple[str, ...] = (*PRESET_NAMES, *RETENTION_SETTINGS)
ALL_PRESETS: tuple[str, ...] = (*DEFAULT_PRESETS, *ENCODER_ONLY_SETTINGS)


def pruning_for(name: str):
    """The PruningConfig of a preset or of a fixed setting."""
    from epd.token_pruning import PruningConfig

    if name in RETENTION_SETTINGS:
        return PruningConfig(**RETENTION_SETTINGS[name])
    if name in ENCODER_ONLY_SETTINGS:
        return PruningConfig(**ENCODER_ONLY_SETTINGS[name])
    return PruningConfig.from_preset(name)


CSV_FIELDS = [
    "preset",
    "question_type",
    "num_questions",
    "num_correct",
    "accuracy",
    "mean_visual_tokens",
    "mean_full_visual_tokens",
    "retained_ratio",
    "mean_kv_bytes",
    "mean_total_ms",
]


@dataclass(frozen=True)
class QualityConfig:
    """One run of the quality bench."""

    model: str = "default"
    """Checkpoint directory, or "default" (epd's default model)."""
    presets: tuple[str, ...] = DEFAULT_PRESETS
    """Pruning presets to evaluate, in order; "off" is the full model."""
    num_test_clips: int = 500
    """Test clips to generate (plus one still image per ten clips); the i-th is always the same.
    With `max_questions` N, at most N of them (`clips_to_render`)."""
    data_dir: str = ""
    """An existing synth dataset holding the test split; empty: build one in a temporary dir."""
    max_questions: int = 0
    """Evaluate only the first N questions of the split (0: all)."""
    out_dir: str = "bench_results/quality"
    """Where CSV, JSON and PNG go."""
    max_new_tokens: int = 8
    """Generation cap: answers are one word, so a few tokens suffice."""
    num_threads: int = 1
    """torch threads of the embedded pipeline."""
    linear_kernel: str = "torch"
    """The model's linear layers: "torch" or "onednn" (`epd.model_runtime.onednn_linear`)."""
    progress: bool = True
    """Show a progress bar."""


@dataclass
class Answer:
    """One question's outcome under one preset."""

    preset: str
    id: str
    question_type: str
    question: str
    expected: str
    answer: str
    correct: bool
    num_visual_tokens: int
    """Visual tokens the language model saw (after any pruning)."""
    num_full_visual_tokens: int
    """Visual tokens before pruning."""
    kv_num_bytes: int
    total_ms: float


@dataclass
class PresetResult:
    preset: str
    answers: list[Answer] = field(default_factory=list)
    refused: str = ""
    """The pipeline's INVALID_ARGUMENT message when the model's family refuses a stage the preset
    turns on (then no question is answered under it); empty when it ran."""

    def rows(self) -> list[dict]:
        """CSV rows: one per question type (sorted), then "overall"; none for a refused preset."""
        if self.refused:
            return []
        by_type: dict[str, list[Answer]] = defaultdict(list)
        for a in self.answers:
            by_type[a.question_type].append(a)
        groups = [(t, by_type[t]) for t in sorted(by_type)] + [("overall", self.answers)]
        return [_row(self.preset, t, group) for t, group in groups]


def _row(preset: str, qtype: str, group: list[Answer]) -> dict:
    n = len(group)
    correct = sum(a.correct for a in group)
    kept = sum(a.num_visual_tokens for a in group) / max(n, 1)
    full = sum(a.num_full_visual_tokens for a in group) / max(n, 1)
    return {
        "preset": preset,
        "question_type": qtype,
        "num_questions": n,
        "num_correct": correct,
        "accuracy": round(correct / max(n, 1), 4),
        "mean_visual_tokens": round(kept, 2),
        "mean_full_visual_tokens": round(full, 2),
        "retained_ratio": round(kept / full, 4) if full else 1.0,
        "mean_kv_bytes": round(sum(a.kv_num_bytes for a in group) / max(n, 1), 1),
        "mean_total_ms": round(sum(a.total_ms for a in group) / max(n, 1), 2),
    }


def pruning_supported() -> bool:
    """True once the pipeline's AskRequest takes a `pruning` option."""
    from epd.gateway.ask_types import AskRequest

    return "pruning" in {f.name for f in dataclasses.fields(AskRequest)}


def runnable_presets(presets: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(presets to run, presets skipped because the pipeline cannot prune yet)."""
    unknown = [p for p in presets if p not in ALL_PRESETS]
    if unknown:
        raise ValueError(f"unknown preset(s) {unknown}; choose from {', '.join(ALL_PRESETS)}")
    if pruning_supported():
        return list(presets), []
    return [p for p in presets if p == "off"] or ["off"], [p for p in presets if p != "off"]


def clips_to_render(config: QualityConfig) -> int:
    """The test clips to generate when no dataset is given: `num_test_clips`, or with
    `max_questions` N at most N. The first N questions are then those of the whole split: the
    manifest lists each clip's questions before the next clip's (the stills after every clip),
    every clip has at least one (a count question), and the i-th clip is the same whatever the
    split's size."""
    if config.max_questions:
        return min(config.num_test_clips, config.max_questions)
    return config.num_test_clips


def build_test_split(out_dir: Path, num_test_clips: int) -> None:
    """`python -m epd.synth.dataset` with only a test split."""
    cmd = [
        sys.executable,
        "-m",
        "epd.synth.dataset",
        "--out",
        str(out_dir),
        "--num-train",
        "0",
        "--num-validation",
        "0",
        "--num-test",
        str(num_test_clips),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)


def _retained_tokens(summary) -> tuple[int, int]:
    """(visual tokens kept, visual tokens before pruning) of one answered request."""
    full = int(summary.num_visual_tokens)
    stats = getattr(summary, "pruning", None)
    if stats is not None and getattr(stats, "stages", None):
        return int(stats.num_visual_tokens_out), int(stats.num_visual_tokens_in)
    return full, full


async def _run_preset(pipeline, preset: str, records, data_dir: Path, config: QualityConfig) -> PresetResult:
    from tqdm import tqdm

    from epd.gateway.ask_types import AskRequest, AskSummary
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput
    from epd.stages.errors import InvalidRequest
    from epd.stages.messages import question_messages
    from epd.video.types import SamplingOptions

    extra = {}
    if pruning_supported():
        extra["pruning"] = pruning_for(preset)
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens)
    result = PresetResult(preset)
    media_cache: dict[str, bytes] = {}
    for r in tqdm(
        records, desc=f"quality [{preset}]", unit="question", disable=not config.progress, mininterval=2
    ):
        data = media_cache.setdefault(r.media, r.media_path(data_dir).read_bytes())
        request = AskRequest(
            messages=question_messages(r.question),
            media=MediaInput(data),
            sampling=SamplingOptions(),
            generation=generation,
            **extra,
        )
        summary = None
        try:
            async for item in pipeline.ask(request):
                if isinstance(item, AskSummary):
                    summary = item
        except InvalidRequest as exc:
            if not extra or not pruning_for(preset).any_enabled:
                raise
            # The family refuses a stage of this preset (the same for every question): report it.
            result.answers, result.refused = [], str(exc)
            return result
        assert summary is not None
        answer = summary.answer.strip().lower()
        kept, full = _retained_tokens(summary)
        result.answers.append(
            Answer(
                preset=preset,
                id=r.id,
                question_type=r.question_type,
                question=r.question,
                expected=r.answer,
                answer=answer,
                correct=answer == r.answer,
                num_visual_tokens=kept,
                num_full_visual_tokens=full,
                kv_num_bytes=int(summary.kv_num_bytes),
                total_ms=float(summary.timings_ms.get("total", 0.0)),
            )
        )
    return result


def evaluate(config: QualityConfig, data_dir: Path, presets: list[str]) -> list[PresetResult]:
    """Answer every test question under each preset with one loaded model."""
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter
    from epd.synth.manifest import read_manifest

    records = read_manifest(data_dir, split="test")
    if config.max_questions:
        records = records[: config.max_questions]
    if not records:
        raise ValueError(f"{data_dir} has no test questions")
    model = ModelConfig(
        model=config.model, num_threads=config.num_threads, linear_kernel=config.linear_kernel
    )
    adapter = load_adapter(model, "all")
    results = []
    for preset in presets:
        with build_embedded_pipeline(model, adapter=adapter) as pipeline:  # fresh encoder cache per preset
            results.append(asyncio.run(_run_preset(pipeline, preset, records, data_dir, config)))
    return results


def format_table(results: list[PresetResult]) -> str:
    """Accuracy per preset (columns) and question type (rows), plus visual tokens kept."""
    types = sorted({a.question_type for r in results for a in r.answers}) + ["overall"]
    rows = {r.preset: {row["question_type"]: row for row in r.rows()} for r in results}
    head = f"{'question type':<14}" + "".join(f"{r.preset:>18}" for r in results)
    lines = [head, "-" * len(head)]
    for t in types:
        cells = []
        for r in results:
            row = rows[r.preset].get(t)
            cells.append(
                f"{row['accuracy']:>7.1%} {row['num_correct']:>4}/{row['num_questions']:<5}"
                if row
                else "refused"
                if r.refused
                else "-"
            )
        lines.append(f"{t:<14}" + "".join(f"{c:>18}" for c in cells))
    lines.append("-" * len(head))
    lines.append(
        f"{'visual tokens':<14}"
        + "".join(
            f"{'-':>18}" if r.refused else f"{rows[r.preset]['overall']['mean_visual_tokens']:>18.1f}"
            for r in results
        )
    )
    lines.append(
        f"{'kept':<14}"
        + "".join(
            f"{'-':>18}" if r.refused else f"{rows[r.preset]['overall']['retained_ratio']:>18.1%}"
            for r in results
        )
    )
    lines += [f"refused {r.preset}: {r.refused}" for r in results if r.refused]
    return "\n".join(lines)


def write_outputs(results: list[PresetResult], out_dir: Path, info: dict) -> dict[str, Path]:
    from epd.train.png_plot import Series, line_plot

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": out_dir / "quality.csv",
        "answers": out_dir / "quality_answers.csv",
        "json": out_dir / "quality.json",
        "png": out_dir / "quality.png",
    }
    all_rows = [row for r in results for row in r.rows()]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(all_rows)
    with open(paths["answers"], "w", newline="") as f:
        names = [fl.name for fl in dataclasses.fields(Answer)]
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(dataclasses.asdict(a) for r in results for a in r.answers)
    paths["json"].write_text(json.dumps({**info, "rows": all_rows}, indent=1) + "\n")
    # One line per question type plus overall; x = mean visual tokens kept under each preset.
    results = [r for r in results if not r.refused]
    if not results:
        paths.pop("png")
        return paths
    overall_rows = {r.preset: r.rows()[-1] for r in results}
    series = [
        Series(
            "overall",
            [overall_rows[r.preset]["mean_visual_tokens"] for r in results],
            [overall_rows[r.preset]["accuracy"] for r in results],
            markers=True,
            labels=[r.preset for r in results],
        )
    ]
    for t in sorted({a.question_type for r in results for a in r.answers}):
        xs, ys = [], []
        for r in results:
            row = next(row for row in r.rows() if row["question_type"] == t)
            xs.append(row["mean_visual_tokens"])
            ys.append(row["accuracy"])
        series.append(Series(t, xs, ys, markers=True))
    line_plot(
        paths["png"],
        series,
        title=f"accuracy vs retained visual tokens ({info['model']})",
        xlabel="mean visual tokens kept per question",
        ylabel="accuracy",
        y_range=(0.0, 1.0),
    )
    return paths


def build_parser() -> argparse.ArgumentParser:
    """`epd bench quality`'s flags, with QualityConfig's defaults."""
    from epd.model_runtime.config import LINEAR_KERNELS

    d = QualityConfig()
    p = argparse.ArgumentParser(prog="epd bench quality", description=__doc__.split("\n")[0])
    measured = p.add_argument_group("model (what is measured)")
    measured.add_argument("--model", default=d.model, help="checkpoint directory or 'default'")
    measured.add_argument(
        "--presets",
        default=",".join(d.presets),
        help=f"comma-separated pruning presets ({', '.join(ALL_PRESETS)})",
    )
    measured.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    measured.add_argument("--threads", type=int, default=d.num_threads, help="torch threads")
    measured.add_argument(
        "--linear-kernel",
        default=d.linear_kernel,
        choices=LINEAR_KERNELS,
        help="the model's linear layers (epd serve's --linear-kernel)",
    )
    data = p.add_argument_group("data (the test split's questions)")
    data.add_argument(
        "--num-test",
        type=int,
        default=d.num_test_clips,
        help="test clips to generate (with --max-questions N, at most N)",
    )
    data.add_argument("--data", default=d.data_dir, help="existing synth dataset with a test split")
    data.add_argument(
        "--max-questions", type=int, default=d.max_questions, help="first N questions only (0: all)"
    )
    output = p.add_argument_group("output")
    output.add_argument("--out", default=d.out_dir, help="output directory")
    output.add_argument("--no-progress", action="store_true")
    add_keyword_help(p)  # vLLM's --help=KEYWORD and --config FILE.yaml, as every `epd` command
    add_config_flag(p)
    return p


def parse_args(argv: list[str] | None) -> QualityConfig:
    a = parse_flexibly(build_parser(), argv)  # --config FILE.yaml, --flag_name: as `epd bench quality`
    return QualityConfig(
        model=a.model,
        presets=tuple(x.strip() for x in a.presets.split(",") if x.strip()),
        num_test_clips=a.num_test,
        data_dir=a.data,
        max_questions=a.max_questions,
        out_dir=a.out,
        max_new_tokens=a.max_new_tokens,
        num_threads=a.threads,
        progress=not a.no_progress,
        linear_kernel=a.linear_kernel,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of `epd bench quality` (argv without the subcommand words)."""
    config = parse_args(argv)
    try:
        presets, skipped = runnable_presets(config.presets)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if skipped:
        print(
            f"note: the pipeline has no pruning option yet; skipping presets {', '.join(skipped)}",
            file=sys.stderr,
        )
    tmp = None
    try:
        if config.data_dir:
            data_dir = Path(config.data_dir)
        else:
            tmp = tempfile.mkdtemp(prefix="epd-quality-")
            data_dir = Path(tmp)
            build_test_split(data_dir, clips_to_render(config))
        from epd.model_runtime.loader import resolve_model_path

        t0 = time.perf_counter()
        results = evaluate(config, data_dir, presets)
        elapsed_s = time.perf_counter() - t0
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    info = {
        "model": resolve_model_path(config.model),
        "presets": presets,
        "skipped_presets": skipped,
        # as generated
        "num_test_clips": config.num_test_clips if config.data_dir else clips_to_render(config),
        "data_dir": config.data_dir or "(generated)",
        "max_questions": config.max_questions,
        "elapsed_s": round(elapsed_s, 1),
        "date": time.strftime("%Y-%m-%d"),
        "answer_counts": {
            r.preset: dict(Counter(a.answer for a in r.answers).most_common(30)) for r in results
        },
        "refused_presets": {r.preset: r.refused for r in results if r.refused},
    }
    paths = write_outputs(results, Path(config.out_dir), info)
    print(format_table(results))
    print(
        f"\n{sum(len(r.answers) for r in results)} answers in {elapsed_s:.0f} s; "
        f"wrote {', '.join(str(p) for p in paths.values())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
