"""The encoder stage's part in bfloat16 / float16 is what `from_pretrained(dtype=...)` makes of the
whole model (what generate() and the embedded mode run): the same parameter and buffer dtypes,
float32 rotary `inv_freq` included, so its visual embeddings equal the whole model's bit for bit.
A `.to(dtype)` of the part rounded the towers' `inv_freq` to bfloat16 and moved every embedding."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from tests.families import FAMILIES, family_checkpoints, load_video

WHOLE_MODEL_PART = (
    "llava_onevision",
    "internvl",
)  # the encoder's part is `model.model`'s tower and projector


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict:
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("dtype_models"))


def _whole_models_part(whole, encoder) -> torch.nn.Module:
    """The whole model's module that the encoder stage loads alone (LLaVA-OneVision's part is the
    tower, projector and image_newline of `model.model`, InternVL's its tower and projector; Qwen's
    the tower `model.model.visual`)."""
    return whole.model.model if whole.hf_config.model_type in WHOLE_MODEL_PART else whole.visual


def _floating_dtypes(named) -> dict[str, torch.dtype]:
    return {name: t.dtype for name, t in named if t.is_floating_point()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_stage_has_the_whole_models_dtypes_and_embeddings(checkpoints, media_files, family, dtype):
    config = ModelConfig(model=str(checkpoints[family]), dtype=dtype)
    whole = load_adapter(config, "all")  # from_pretrained(dtype=...), as generate() runs
    encoder = load_adapter(config, "encoder")
    assert encoder.model is None, "the encoder stage loaded the whole model: this test would prove nothing"
    part = _whole_models_part(whole, encoder)

    # non-persistent buffers (inv_freq) too: state_dict() leaves them out
    buffers = _floating_dtypes(encoder.visual.named_buffers())
    whole_buffers = _floating_dtypes(part.named_buffers())
    assert buffers == {name: whole_buffers[name] for name in buffers}
    params = _floating_dtypes(encoder.visual.named_parameters())
    assert params == {
        name: d for name, d in _floating_dtypes(part.named_parameters()).items() if name in params
    }
    assert set(params.values()) == {getattr(torch, dtype)}
    if family not in WHOLE_MODEL_PART:  # SigLIP and InternViT have learned positions, no rotary
        assert buffers["rotary_pos_emb.inv_freq"] == torch.float32, "the case this test is about"

    inputs = whole.preprocess(load_video(media_files, "mp4", 8))
    got, expected = encoder.encode_features(inputs), whole.encode_features(inputs)
    assert torch.equal(got.embeds, expected.embeds)  # [num_visual_tokens, hidden], bit for bit
    assert (got.deepstack is None) == (expected.deepstack is None)
    for layer_got, layer_expected in zip(got.deepstack or [], expected.deepstack or [], strict=True):
        assert torch.equal(layer_got, layer_expected)


def test_modules_a_model_keeps_in_float32_stay_float32_in_the_encoder_stage(checkpoints, monkeypatch):
    """A tower class naming `_keep_in_fp32_modules_strict` (none of the supported ones does today):
    from_pretrained keeps those parameters float32 in bfloat16, and so does the encoder stage."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    monkeypatch.setattr(Qwen2VisionTransformerPretrainedModel, "_keep_in_fp32_modules_strict", ["merger"])
    config = ModelConfig(model=str(checkpoints["qwen2_vl"]), dtype="bfloat16")
    whole, encoder = load_adapter(config, "all"), load_adapter(config, "encoder")
    params = _floating_dtypes(encoder.visual.named_parameters())
    assert params == _floating_dtypes(whole.visual.named_parameters())
    assert (
        {name for name, d in params.items() if d == torch.float32}
        == {name for name in params if name.startswith("merger.")}
        != set()
    )
    assert all(torch.equal(encoder.visual.get_parameter(n), whole.visual.get_parameter(n)) for n in params)


def test_a_vision_config_of_its_own_dtype_does_not_override_the_stage_dtype(checkpoints, tmp_path):
    """from_pretrained gives `dtype` to every sub-config; LLaVA-OneVision's part builds its SigLIP
    tower from the vision config, whose own `dtype` (float32 here) would otherwise win."""
    import json
    import shutil

    checkpoint = shutil.copytree(checkpoints["llava_onevision"], tmp_path / "llava_onevision")
    config_json = json.loads((checkpoint / "config.json").read_text())
    config_json["vision_config"]["dtype"] = "float32"
    (checkpoint / "config.json").write_text(json.dumps(config_json))
    encoder = load_adapter(ModelConfig(model=str(checkpoint), dtype="bfloat16"), "encoder")
    assert set(_floating_dtypes(encoder.visual.named_parameters()).values()) == {torch.bfloat16}
