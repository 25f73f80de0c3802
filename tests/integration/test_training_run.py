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
    build_dataset(data, DatasetConfig(num_videos={"train": 3, "validation": 1, "test": 1}, image_ratio=0.0),
                  progress=False)
    cache = tmp_path / "prepared.pt"
    args = ["--data", str(data), "--num-train", "3", "--num-validation", "1", "--num-test", "1",
            "--steps", "4", "--clips-per-step", "2", "--eval-every", "0", "--hidden-size", "32",
            "--intermediate-size", "64", "--vision-depth", "1", "--vision-dim", "32", "--vision-heads", "2",
            "--no-progress", "--prepared-cache", str(cache), "--vision-pretrain-steps", "0", "--threads", "1"]
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
    assert plain["aux_loss_every_10_steps"] == [] and plain["loss_every_10_steps"] != log["loss_every_10_steps"]
    # Phase 1 (vision tower + auxiliary head alone) runs first and changes what phase 2 starts from.
    assert main([*args, "--vision-pretrain-steps", "3", "--out", str(tmp_path / "d")]) == 0
    staged = json.loads((tmp_path / "d" / "training_log.json").read_text())
    assert len(staged["vision_pretrain_loss_every_10_steps"]) == 1
    assert staged["loss_every_10_steps"] != log["loss_every_10_steps"]
