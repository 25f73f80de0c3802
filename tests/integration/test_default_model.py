"""The shipped default model (models/epd-tiny-videoqa) and `epd bench quality`, end to end.

The clips are the first test-split clips of synth, rendered in the test: the model never saw them
(training uses train seeds only), and they are the same clips `epd bench quality` starts with.
"""

from __future__ import annotations

import asyncio
import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.stack import ROOT

SHIPPED = ROOT / "models" / "epd-tiny-videoqa"
NUM_CLIPS = 10


@pytest.fixture(scope="module")
def test_clips(tmp_path_factory) -> Path:
    """The first 10 clips (and 1 still image) of the test split, with their manifest."""
    from epd.synth.dataset import DatasetConfig, build_dataset

    out = tmp_path_factory.mktemp("synth_test")
    build_dataset(out, DatasetConfig(num_videos={"test": NUM_CLIPS}), progress=False)
    return out


@pytest.fixture(scope="module")
def pipeline_answers(test_clips) -> list[tuple[object, str]]:
    """(record, generated answer) for every question of the clips, through the embedded pipeline."""
    from epd.gateway.ask_types import AskRequest, AskSummary
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput
    from epd.stages.messages import question_messages
    from epd.synth.manifest import read_manifest

    pipeline = build_embedded_pipeline(ModelConfig(model=str(SHIPPED)))

    async def ask_all():
        out = []
        for r in read_manifest(test_clips, split="test"):
            req = AskRequest(
                question_messages(r.question),
                MediaInput(r.media_path(test_clips).read_bytes()),
                generation=GenerationConfig(max_new_tokens=8),
            )
            summary = [x async for x in pipeline.ask(req) if isinstance(x, AskSummary)][0]
            out.append((r, summary.answer.strip()))
        return out

    try:
        return asyncio.run(ask_all())
    finally:
        pipeline.close()


def test_shipped_model_is_the_default_and_is_trained():
    from epd.model_runtime.default_model import default_model_path, is_meaningless

    assert (SHIPPED / "config.json").exists(), (
        "models/epd-tiny-videoqa is missing; run epd.train.train_default_model"
    )
    assert not is_meaningless(SHIPPED)
    card = json.loads((SHIPPED / "epd_model_card.json").read_text())
    assert card["accuracy"]["test"] >= 0.9
    assert {"command", "seed", "data"} <= set(card)
    weights = sum(f.stat().st_size for f in SHIPPED.glob("*.safetensors"))
    assert 0 < weights < 30_000_000  # small enough to commit
    import os

    if "EPD_DEFAULT_MODEL" not in os.environ:
        assert default_model_path() == SHIPPED


def test_from_pretrained_generate_answers_the_bundled_sample():
    """Plain transformers (AutoProcessor + from_pretrained + generate), no epd code in the loop."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from epd.video.simple_decoder import decode
    from epd.video.types import SamplingOptions

    processor = AutoProcessor.from_pretrained(SHIPPED)
    model = AutoModelForImageTextToText.from_pretrained(SHIPPED).eval()
    video = decode((ROOT / "samples" / "sample.mp4").read_bytes(), SamplingOptions())
    sample = json.loads((ROOT / "samples" / "sample.json").read_text())["video"]["questions"]
    answers = {}
    for qa in sample:
        messages = [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": qa["question"]}]}
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(
            text=[text],
            videos=[video.frames],
            return_tensors="pt",
            videos_kwargs={"do_sample_frames": False, "fps": video.sampled_fps},
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        new = out[0, inputs["input_ids"].shape[1] :]
        answers[qa["question"]] = processor.tokenizer.decode(new, skip_special_tokens=True).strip()
    assert answers["what colour is the circle?"] == "yellow"
    correct = sum(answers[qa["question"]] == qa["answer"] for qa in sample)
    assert correct >= len(sample) - 1, answers


def test_answers_ten_test_clips_through_the_serving_pipeline(pipeline_answers):
    by_clip: dict[str, list[bool]] = {}
    for r, answer in pipeline_answers:
        by_clip.setdefault(r.media, []).append(answer == r.answer)
    assert sum(m.startswith("test/videos/") for m in by_clip) == NUM_CLIPS
    # A clip counts as answered when at most one of its questions is wrong.
    videos = [ok for m, ok in by_clip.items() if m.startswith("test/videos/")]
    assert sum(len(ok) - sum(ok) <= 1 for ok in videos) >= 9, pipeline_answers
    total = sum(answer == r.answer for r, answer in pipeline_answers)
    assert total >= 0.9 * len(pipeline_answers), [
        (r.question, r.answer, a) for r, a in pipeline_answers if a != r.answer
    ]


def test_training_accuracy_equals_served_greedy_answers(test_clips, pipeline_answers):
    """The trainer's teacher-forced accuracy says 'correct' exactly when the served greedy answer
    is right: training inputs are prepared as the serving path prepares them."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
    from epd.train.accuracy import evaluate
    from epd.train.prepare import load_split

    adapter = Qwen2VLAdapter(str(SHIPPED), ModelConfig(), {"vision", "language"})
    examples, media = load_split(test_clips, "test", adapter, progress=False)
    pad_id = adapter.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for e, (r, _) in zip(examples, pipeline_answers):
        supervised = e.labels[e.labels != -100].tolist()
        assert adapter.tokenizer.decode(supervised) == r.answer + "<|im_end|>"
    per_question = [evaluate(adapter.model, [e], media, pad_id)[e.question_type][0] == 1 for e in examples]
    served = [answer == r.answer for r, answer in pipeline_answers]
    assert per_question == served


def test_bench_quality_writes_consistent_outputs(tmp_path, test_clips):
    from PIL import Image

    from epd.bench.quality import main

    out = tmp_path / "quality"
    rc = main(
        [
            "--model",
            str(SHIPPED),
            "--data",
            str(test_clips),
            "--max-questions",
            "20",
            "--presets",
            "off",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(open(out / "quality.csv")))
    answers = list(csv.DictReader(open(out / "quality_answers.csv")))
    assert len(answers) == 20
    per_type = [r for r in rows if r["question_type"] != "overall"]
    (total,) = [r for r in rows if r["question_type"] == "overall"]
    assert sum(int(r["num_questions"]) for r in per_type) == int(total["num_questions"]) == 20
    assert sum(int(r["num_correct"]) for r in per_type) == int(total["num_correct"])
    assert Counter(a["question_type"] for a in answers) == {
        r["question_type"]: int(r["num_questions"]) for r in per_type
    }
    for r in rows:
        assert float(r["accuracy"]) == pytest.approx(
            int(r["num_correct"]) / int(r["num_questions"]), abs=1e-4
        )
        assert 0 < float(r["mean_visual_tokens"]) <= float(r["mean_full_visual_tokens"])
    for a in answers:
        assert (a["correct"] == "True") == (a["answer"] == a["expected"])
    assert int(total["num_correct"]) == sum(a["correct"] == "True" for a in answers)
    with Image.open(out / "quality.png") as img:
        assert img.size == (800, 500)
    saved = json.loads((out / "quality.json").read_text())
    assert [(r["question_type"], r["num_questions"], r["num_correct"]) for r in saved["rows"]] == [
        (r["question_type"], int(r["num_questions"]), int(r["num_correct"])) for r in rows
    ]


def test_bench_quality_measures_the_onednn_linear_kernel_against_torchs(tmp_path, test_clips, monkeypatch):
    """The quality of `--linear-kernel onednn` is measured, not assumed: the same questions through
    both kernels, oneDNN's kernel called only in its run (docs/benchmarks.md, "oneDNN linear
    layers", for 1,000 questions)."""
    from epd.bench.quality import main
    from epd.model_runtime import onednn_linear

    kernel_calls = []
    real = onednn_linear._onednn_linear
    monkeypatch.setattr(onednn_linear, "_onednn_linear", lambda *a: kernel_calls.append(1) or real(*a))
    answers = {}
    for kernel in ("torch", "onednn"):
        kernel_calls.clear()
        out = tmp_path / kernel
        assert (
            main(
                [
                    "--model",
                    str(SHIPPED),
                    "--data",
                    str(test_clips),
                    "--max-questions",
                    "12",
                    "--presets",
                    "off",
                    "--out",
                    str(out),
                    "--no-progress",
                    "--linear-kernel",
                    kernel,
                ]
            )
            == 0
        )
        answers[kernel] = [(a["id"], a["answer"]) for a in csv.DictReader(open(out / "quality_answers.csv"))]
        assert bool(kernel_calls) == (kernel == "onednn"), kernel
    assert len(answers["torch"]) == 12
    assert [i for i, _ in answers["onednn"]] == [i for i, _ in answers["torch"]]


def test_bench_quality_renders_only_the_clips_its_first_questions_need(tmp_path):
    """Without --data, `--max-questions N` renders at most N test clips (not the 500 of the whole
    split), and its first N questions are those of a larger split, on the same clips."""
    from epd.bench.quality import QualityConfig, build_test_split, clips_to_render
    from epd.synth.manifest import read_manifest

    config = QualityConfig(num_test_clips=8, max_questions=3)
    assert clips_to_render(config) == 3 and clips_to_render(QualityConfig(num_test_clips=8)) == 8
    assert clips_to_render(QualityConfig(num_test_clips=2, max_questions=3)) == 2
    few, whole = tmp_path / "few", tmp_path / "whole"
    build_test_split(few, clips_to_render(config))
    build_test_split(whole, config.num_test_clips)
    first = read_manifest(few, split="test")[: config.max_questions]
    assert (
        len(first) == config.max_questions
        and first == read_manifest(whole, split="test")[: config.max_questions]
    )
    assert all((few / r.media).read_bytes() == (whole / r.media).read_bytes() for r in first)
    assert len(list((few / "test" / "videos").iterdir())) == 3


def test_bench_quality_refuses_an_unknown_preset(tmp_path, capsys):
    from epd.bench.quality import main

    assert main(["--presets", "off,extreme", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "unknown preset(s) ['extreme']" in capsys.readouterr().err


def test_bench_quality_retention_setting_keeps_its_share_of_tokens(tmp_path, test_clips):
    from epd.bench.quality import RETENTION_SETTINGS, main, pruning_for

    assert (
        pruning_for("keep25").prefill_keep_ratio == 0.25
        and pruning_for("keep25-kvbf16").kv_dtype == "bfloat16"
    )
    assert set(RETENTION_SETTINGS) == {"keep50", "keep25", "keep10", "keep25-kvbf16"}
    out = tmp_path / "quality"
    assert (
        main(
            [
                "--model",
                str(SHIPPED),
                "--data",
                str(test_clips),
                "--max-questions",
                "6",
                "--presets",
                "keep25",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    (total,) = [r for r in csv.DictReader(open(out / "quality.csv")) if r["question_type"] == "overall"]
    assert total["preset"] == "keep25"
    # ceil(0.25 * 48) = 12 of a clip's 48 tokens, ceil(0.25 * 16) = 4 of a still's 16.
    assert 0.25 <= float(total["retained_ratio"]) <= 0.26
