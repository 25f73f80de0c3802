"""`python -m epd.train.train_default_model` end to end on a tiny setting: it trains with the dense
auxiliary loss, saves a checkpoint that loads through from_pretrained, and reuses prepared data."""

from __future__ import annotations

import json

import torch


def test_training_run_saves_a_loadable_model_and_reuses_prepared_splits(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from epd.synth.dataset import DatasetConfig, build_dataset
    from epd.train.train_default_model import main

    data = tmp_path / "data"
    build_dataset(
        data,
        DatasetConfig(num_videos={"train": 3, "validation": 1, "test": 1}, image_ratio=0.0),
        progress=False,
    )
    cache = tmp_path / "prepared.pt"
    args = [
        "--data",
        str(data),
        "--num-train",
        "3",
        "--num-validation",
        "1",
        "--num-test",
        "1",
        "--steps",
        "4",
        "--clips-per-step",
        "2",
        "--eval-every",
        "0",
        "--hidden-size",
        "32",
        "--intermediate-size",
        "64",
        "--vision-depth",
        "1",
        "--vision-dim",
        "32",
        "--vision-heads",
        "2",
        "--no-progress",
        "--prepared-cache",
        str(cache),
        "--vision-pretrain-steps",
        "0",
        "--threads",
        "1",
    ]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    log = json.loads((tmp_path / "a" / "training_log.json").read_text())
    assert log["config"]["aux_weight"] == 1.0 and len(log["aux_loss_every_10_steps"]) == 1
    assert all(v > 0 for v in log["aux_loss_every_10_steps"])
    assert (tmp_path / "a" / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "a")
    assert not any("proj" in k and "aux" in k for k in model.state_dict())  # the aux head is not saved
    saved = torch.load(cache, weights_only=False)
    assert len(saved["splits"]["train"][1]) == 3 and saved["splits"]["train"][1][0]["aux"] is not None

    # Same data, another run: the prepared splits come from the cache file (and give the same run).
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "training_log.json").read_text())
    assert again["loss_every_10_steps"] == log["loss_every_10_steps"]
    # Answers only (--aux-weight 0) trains another model from the same seed.
    assert main([*args, "--aux-weight", "0", "--out", str(tmp_path / "c")]) == 0
    plain = json.loads((tmp_path / "c" / "training_log.json").read_text())
    assert (
        plain["aux_loss_every_10_steps"] == [] and plain["loss_every_10_steps"] != log["loss_every_10_steps"]
    )
    # Phase 1 (vision tower + auxiliary head alone) runs first and changes what phase 2 starts from.
    assert main([*args, "--vision-pretrain-steps", "3", "--out", str(tmp_path / "d")]) == 0
    staged = json.loads((tmp_path / "d" / "training_log.json").read_text())
    assert len(staged["vision_pretrain_loss_every_10_steps"]) == 1
    assert staged["loss_every_10_steps"] != log["loss_every_10_steps"]


def test_qwen3_vl_training_run_saves_a_model_epd_serves(tmp_path):
    """`--family qwen3_vl` builds a Qwen3-VL (DeepStack from the tower layers before the last),
    trains both phases on the same data, and saves a checkpoint epd's loader serves as qwen3_vl;
    `epd bench quality` answers under the encoder stages it supports and reports the others as
    refused."""
    from transformers import Qwen3VLForConditionalGeneration

    from epd.bench import quality
    from epd.model_runtime.loader import check_model_dir
    from epd.synth.dataset import DatasetConfig, build_dataset
    from epd.train.train_default_model import main

    data = tmp_path / "data"
    build_dataset(
        data,
        DatasetConfig(num_videos={"train": 2, "validation": 1, "test": 1}, image_ratio=0.5),
        progress=False,
    )
    out = tmp_path / "q3"
    assert (
        main(
            [
                "--family",
                "qwen3_vl",
                "--data",
                str(data),
                "--num-train",
                "2",
                "--num-validation",
                "1",
                "--num-test",
                "1",
                "--steps",
                "3",
                "--clips-per-step",
                "2",
                "--eval-every",
                "0",
                "--hidden-size",
                "32",
                "--intermediate-size",
                "64",
                "--vision-depth",
                "2",
                "--vision-dim",
                "32",
                "--vision-heads",
                "2",
                "--no-progress",
                "--vision-pretrain-steps",
                "2",
                "--threads",
                "1",
                "--prepare-workers",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    log = json.loads((out / "training_log.json").read_text())
    assert log["config"]["family"] == "qwen3_vl" and len(log["vision_pretrain_loss_every_10_steps"]) == 1
    card = json.loads((out / "epd_model_card.json").read_text())
    assert card["spec"]["family"] == "qwen3_vl" and card["spec"]["deepstack_visual_indexes"] == [0]
    assert check_model_dir(str(out)) == "qwen3_vl"
    model = Qwen3VLForConditionalGeneration.from_pretrained(out)
    assert model.config.vision_config.deepstack_visual_indexes == [0]
    assert not any("aux" in k for k in model.state_dict())

    bench = tmp_path / "bench"
    assert (
        quality.main(
            [
                "--model",
                str(out),
                "--data",
                str(data),
                "--presets",
                "off,light,temporal05-keys05",
                "--max-questions",
                "2",
                "--out",
                str(bench),
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads((bench / "quality.json").read_text())
    assert set(result["refused_presets"]) == {"light"}
    assert (
        "spatial_merge" in result["refused_presets"]["light"]
        and "qwen3_vl" in result["refused_presets"]["light"]
    )
    overall = {r["preset"]: r for r in result["rows"] if r["question_type"] == "overall"}
    assert set(overall) == {"off", "temporal05-keys05"} and overall["off"]["num_questions"] == 2


def test_other_families_need_an_out_directory():
    """The default --out is the shipped Qwen2-VL model's directory: another family must name one."""
    import pytest

    from epd.train.train_default_model import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--family", "qwen3_vl"])
    config, args = parse_args(["--family", "qwen3_vl", "--out", "/tmp/x"])
    assert config.family == "qwen3_vl" and args.out == "/tmp/x"
    config, args = parse_args([])
    assert config.family == "qwen2_vl" and args.out.endswith("epd-tiny-videoqa")
