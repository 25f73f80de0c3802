"""Each stage loads only its part of the checkpoint (issue #22 item 3): the encoder reads only the
vision tower's tensors, prefill and decode only the language model's, and what they load equals
the whole model's weights. Both key layouts: the hub's (the shipped demo model) and the one
transformers 5 writes (the tiny checkpoints). The loader gives each stage its parts (one table for
every family; the adapter tests' `load_stage_adapters` check each family's encoder and one language
stage)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import hide_transformers_bars, language_key, safetensors_files, vision_key
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.resources import demo_model_dir


def _checkpoints(tiny_models) -> dict[str, str]:
    return {
        "shipped (hub keys)": str(demo_model_dir()),
        **{f"{k} (v5 keys)": str(v) for k, v in tiny_models.items()},
    }


def _keys(path: str) -> list[str]:
    root, files = safetensors_files(path)
    assert files, path
    keys = []
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            keys += list(f.keys())
    return keys


def test_every_tensor_is_read_by_exactly_one_part(tiny_models):
    for name, path in _checkpoints(tiny_models).items():
        keys = _keys(path)
        vision = [k for k in keys if vision_key(k) is not None]
        language = [k for k in keys if language_key(k) is not None]
        assert vision and language, name
        assert not set(vision) & set(language), f"{name}: a tensor read by both parts"
        assert set(vision) | set(language) == set(keys), f"{name}: tensors no part reads"
        assert all("visual" in k for k in vision) and not any("visual" in k for k in language), name


@pytest.mark.parametrize("which", ["shipped (hub keys)", "qwen2_vl (v5 keys)", "qwen2_5_vl (v5 keys)"])
def test_one_part_stages_load_exactly_the_whole_models_weights_of_their_part(tiny_models, which):
    path = _checkpoints(tiny_models)[which]
    whole = Qwen2VLAdapter(path, ModelConfig(), {"vision", "language"})
    language = Qwen2VLAdapter(path, ModelConfig(), {"language"})  # prefill, decode
    vision = Qwen2VLAdapter(path, ModelConfig(), {"vision"})  # encoder

    assert language.visual is None and vision.model is None
    assert not any("visual" in n for n, _ in language.model.named_parameters()), "the tower was built"
    expected = {k: v for k, v in whole.model.state_dict().items() if not k.startswith("model.visual.")}
    got = language.model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    tower = vision.visual.state_dict()
    assert tower.keys() == whole.visual.state_dict().keys()
    assert all(torch.equal(tower[k], v) for k, v in whole.visual.state_dict().items())
    assert (
        language.language_model.config._attn_implementation
        == whole.language_model.config._attn_implementation
    )


def test_a_prompt_only_adapter_loads_no_weights(tiny_models):
    adapter = Qwen2VLAdapter(str(tiny_models["qwen2_vl"]), ModelConfig(), set())
    assert adapter.model is None and adapter.visual is None


@pytest.mark.parametrize(
    ("stage", "tower", "language"),
    [("encoder", True, False), ("prefill", False, True), ("decode", False, True), ("all", True, True)],
)
def test_the_loader_gives_each_stage_its_parts(tiny_models, stage, tower, language):
    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), stage)
    assert adapter.parts == ({"vision"} if tower else set()) | ({"language"} if language else set())
    assert (adapter.visual is not None, adapter.model is not None) == (tower, language)


def test_hidden_transformers_bars_leave_a_whole_model_load_silent(tiny_models, capfd):
    """`epd serve --colocate` loads the whole model through transformers, which draws a "Loading
    weights" bar on stderr unless told not to (the stack's one-part stages draw none)."""
    from transformers.utils import logging as transformers_logging

    hide_transformers_bars()
    try:
        Qwen2VLAdapter(str(tiny_models["qwen2_vl"]), ModelConfig(), {"vision", "language"})
    finally:
        transformers_logging.set_tqdm_hook(None)
    assert "Loading weights" not in capfd.readouterr().err
