"""The trainer's Qwen3-VL pieces (`--family qwen3_vl`) on a tiny checkpoint and real synth clips:
the model it builds, inputs prepared by the Qwen3-VL serving adapter (timestamped video prompt),
and the per-clip tower run with DeepStack features equal to the model's own forward."""

from __future__ import annotations

import pytest
import torch


def _config(**size):
    from epd.train.config import ModelSize, TrainConfig

    return TrainConfig(family="qwen3_vl", size=ModelSize(**size))


def test_deepstack_uses_the_tower_layers_before_the_last_one_per_language_layer():
    from epd.train.config import TrainConfig
    from epd.train.model import deepstack_layers, model_spec

    assert deepstack_layers(_config()) == (1, 2)  # the default sizes: vision 4 blocks, text 2 layers
    assert deepstack_layers(_config(vision_depth=2)) == (0,)
    assert deepstack_layers(_config(vision_depth=8, num_hidden_layers=6)) == (4, 5, 6)
    assert model_spec(_config()).deepstack_visual_indexes == (1, 2)
    assert model_spec(TrainConfig()).family == "qwen2_vl"
    with pytest.raises(ValueError, match="qwen2_vl or qwen3_vl"):
        model_spec(TrainConfig(family="qwen3_5"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny Qwen3-VL built as the trainer builds it (hf init + synth words), and the train
    split of 2 clips + 1 still prepared through its serving adapter."""
    from epd.model_runtime.tiny_model import build_model, build_processor
    from epd.synth.dataset import DatasetConfig, build_dataset
    from epd.train.model import model_spec, save_model, serving_adapter
    from epd.train.prepare import load_split

    root = tmp_path_factory.mktemp("train_q3")
    build_dataset(root / "data", DatasetConfig(num_videos={"train": 2}, image_ratio=0.5), progress=False)
    spec = model_spec(
        _config(
            hidden_size=64, intermediate_size=128, vision_depth=2, vision_embed_dim=32, vision_num_heads=2
        )
    )
    processor = build_processor(spec)
    torch.manual_seed(0)
    model = build_model(spec, processor.tokenizer)
    save_model(model, processor, root / "model")
    adapter = serving_adapter(root / "model")
    examples, media = load_split(root / "data", "train", adapter, progress=False, compact=True)
    return adapter, model, examples, media


def test_inputs_come_from_the_qwen3_vl_adapter_with_timestamps(prepared):
    adapter, _, examples, media = prepared
    assert type(adapter).__name__ == "Qwen3VLAdapter"
    video = next(e for e in examples if media[e.media_index].modality == "video")
    text = adapter.tokenizer.decode(video.input_ids)
    assert "seconds>" in text and text.endswith(video.answer + "<|im_end|>")
    # 112 x 112 frames -> 128 x 128 at patch 16: 3 groups of 4 x 4 merged tokens, as Qwen2-VL's 48.
    assert media[video.media_index].grid_thw == (3, 8, 8)
    assert int((video.input_ids == adapter.hf_config.video_token_id).sum()) == 48


def test_shared_vision_inputs_carry_deepstack_and_equal_the_model_forward(prepared):
    from epd.train.batches import collate, shared_vision_inputs

    _, model, examples, media = prepared
    model.eval()
    batch = (
        examples[:4] + [e for e in examples if media[e.media_index].modality == "image"][:2] + examples[-3:]
    )
    with torch.no_grad():
        full = model(**collate(batch, media, pad_id=0))
        inputs = shared_vision_inputs(model, batch, media, pad_id=0)[0]
        shared = model(**inputs)
    assert torch.allclose(full.logits, shared.logits, atol=1e-5)
    # Without the DeepStack features the logits differ: the shared path really carries them.
    for entry in inputs["mm_encoder_outputs"].values():
        entry.deepstack_features = [
            [torch.zeros_like(x) for x in layer] for layer in entry.deepstack_features
        ]
    with torch.no_grad():
        without = model(**inputs)
    assert not torch.allclose(without.logits, shared.logits, atol=1e-4)
