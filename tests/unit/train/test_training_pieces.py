"""The trainer's pieces on a tiny real checkpoint and real synth clips: token ids and labels,
batching, the schedule, the training-friendly model options, and the PNG plot."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    """A tiny training-style checkpoint (hf init + synth words) under model/ and 2 clips + 1
    image under data/."""
    from epd.model_runtime.tiny_model import build_model, build_processor
    from epd.synth.dataset import DatasetConfig, build_dataset
    from epd.train.config import ModelSize, TrainConfig
    from epd.train.model import model_spec, save_model

    root = tmp_path_factory.mktemp("train")
    build_dataset(root / "data", DatasetConfig(num_videos={"train": 2}, image_ratio=0.5), progress=False)
    config = TrainConfig(
        size=ModelSize(
            hidden_size=64, intermediate_size=128, vision_depth=1, vision_embed_dim=32, vision_num_heads=2
        )
    )
    spec = model_spec(config)
    processor = build_processor(spec)
    save_model(build_model(spec, processor.tokenizer), processor, root / "model")
    return root


@pytest.fixture(scope="module")
def prepared(train_root):
    """The train split prepared by the trainer through the serving adapter."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
    from epd.train.prepare import load_split

    adapter = Qwen2VLAdapter(str(train_root / "model"), ModelConfig(), {"vision", "language"})
    examples, media = load_split(train_root / "data", "train", adapter, progress=False)
    return adapter, examples, media


def test_labels_cover_exactly_the_answer_and_im_end(prepared):
    from epd.synth.questions import ANSWER_VOCAB

    adapter, examples, _ = prepared
    assert len(examples) >= 10
    for e in examples:
        supervised = e.labels != -100
        first = int(supervised.nonzero()[0])
        assert supervised[first:].all()  # one contiguous run at the end
        text = adapter.tokenizer.decode(e.input_ids[supervised].tolist())
        assert text == e.answer + "<|im_end|>"
        assert e.answer in ANSWER_VOCAB
        assert adapter.tokenizer.decode(e.input_ids[:first].tolist()).endswith("<|im_start|>assistant\n")


def test_media_are_prepared_as_the_encoder_service_does(prepared):
    _, examples, media = prepared
    videos = [m for m in media if m.modality == "video"]
    images = [m for m in media if m.modality == "image"]
    assert len(videos) == 2 and len(images) == 1
    # 3 s at 2 fps = 6 frames -> 3 temporal groups of 8x8 patches; a 112x112 still -> 1 group.
    assert all(m.grid_thw == (3, 8, 8) for m in videos)
    assert images[0].grid_thw == (1, 8, 8)
    assert videos[0].pixel_values().shape == (3 * 8 * 8, 3 * 2 * 14 * 14)


def test_collate_pads_right_and_orders_visual_inputs_like_the_batch(prepared):
    from epd.train.batches import collate

    adapter, examples, media = prepared
    image_ex = next(e for e in examples if media[e.media_index].modality == "image")
    video_ex = [e for e in examples if media[e.media_index].modality == "video"][:2]
    batch = [video_ex[0], image_ex, video_ex[1]]
    out = collate(batch, media, pad_id=0)
    length = max(len(e.input_ids) for e in batch)
    assert out["input_ids"].shape == (3, length)
    assert out["position_ids"].shape == (4, 3, length)
    assert out["attention_mask"].sum(1).tolist() == [len(e.input_ids) for e in batch]
    assert out["video_grid_thw"].tolist() == [[3, 8, 8], [3, 8, 8]]
    assert out["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert torch.equal(out["pixel_values_videos"][:192], media[video_ex[0].media_index].pixel_values())
    short = min(range(3), key=lambda i: len(batch[i].input_ids))
    n = len(batch[short].input_ids)
    if n < length:
        assert (out["labels"][short, n:] == -100).all()


def test_one_step_lowers_the_loss_on_its_batch(prepared):
    """The model, batch and labels fit together: a few AdamW steps on one batch reduce its loss."""
    from epd.train.batches import collate

    adapter, examples, media = prepared
    model = adapter.model
    torch.manual_seed(0)
    inputs = collate(examples[:4], media, pad_id=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(5):
        loss = model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    assert losses[0] > 4.0  # near ln(vocab): the training init is not a saturated random model
    assert losses[-1] < losses[0] - 0.5


def test_learning_rate_warms_up_then_decays_to_the_floor():
    from epd.train.config import TrainConfig
    from epd.train.trainer import lr_at

    c = TrainConfig(steps=1000, warmup_steps=100, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(1e-5)
    assert lr_at(99, c) == pytest.approx(1e-3)
    assert lr_at(550, c) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert lr_at(999, c) == pytest.approx(1e-4, rel=1e-3)
    values = [lr_at(s, c) for s in range(100, 1000)]
    assert values == sorted(values, reverse=True)


def test_phase_two_groups_scale_only_the_vision_tower_and_aux_head(prepared):
    from epd.train.aux_targets import AuxHead
    from epd.train.config import TrainConfig
    from epd.train.trainer import _param_groups

    model = prepared[0].model
    head = AuxHead(model.config.text_config.hidden_size)
    groups = _param_groups(model, head, TrainConfig(vision_lr_scale=0.25))
    vision = {id(p) for p in model.model.visual.parameters()} | {id(p) for p in head.parameters()}
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted({id(p) for p in model.parameters()} | {id(p) for p in head.parameters()})
    for g in groups:
        assert g["lr_scale"] == (0.25 if id(g["params"][0]) in vision else 1.0)
        assert all((id(p) in vision) == (g["lr_scale"] == 0.25) for p in g["params"])
        assert all((p.dim() >= 2) == (g["weight_decay"] > 0) for p in g["params"])


def test_tiny_model_training_options_leave_the_defaults_alone():
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_model, build_processor

    base = TinyVLMSpec()
    assert base.init == "scaled" and base.extra_words == ()

    def num_tokens(spec: TinyVLMSpec, word: str) -> int:
        return len(build_processor(spec).tokenizer(word, add_special_tokens=False)["input_ids"])

    assert num_tokens(TinyVLMSpec(vocab_size=1024), " appear") > 1
    words = TinyVLMSpec(vocab_size=1024, extra_words=("appear", "later", "leave"))
    assert num_tokens(words, " appear") == 1  # as inside a question
    tok = build_processor(base).tokenizer
    torch.manual_seed(0)
    hf = build_model(TinyVLMSpec(init="hf"), tok)
    std = hf.model.language_model.layers[0].mlp.up_proj.weight.std().item()
    assert std == pytest.approx(0.02, rel=0.2)
    scaled = build_model(base, build_processor(base).tokenizer)
    assert scaled.model.language_model.layers[0].mlp.up_proj.weight.std().item() > 0.1
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        build_model(TinyVLMSpec(init="xavier"), tok)


def test_line_plot_draws_each_series_in_its_colour(tmp_path):
    from PIL import Image

    from epd.train.png_plot import Series, line_plot

    path = line_plot(
        tmp_path / "p.png",
        [Series("a", [0, 1, 2], [3.0, 2.0, 1.0]), Series("b", [0, 2], [1.5, 2.5], markers=True)],
        title="t",
        xlabel="x",
        ylabel="y",
        log_y=True,
    )
    with Image.open(path) as img:
        colours = {c for _, c in img.convert("RGB").getcolors(1 << 20)}
    assert (31, 119, 180) in colours and (255, 127, 14) in colours
    with pytest.raises(ValueError, match="every series is empty"):
        line_plot(tmp_path / "q.png", [Series("a", [], [])], title="t", xlabel="x", ylabel="y")


def test_shared_vision_inputs_equal_the_per_question_forward(prepared):
    """Running the tower once per clip for all its questions gives the model's own per-question
    forward (the path generation and serving take), to float rounding."""
    from epd.train.batches import collate, shared_vision_inputs

    adapter, examples, media = prepared
    model = adapter.model
    batch = examples[:5] + [e for e in examples if media[e.media_index].modality == "image"][:2]
    with torch.no_grad():
        full = model(**collate(batch, media, pad_id=0))
        shared = model(**shared_vision_inputs(model, batch, media, pad_id=0)[0])
    assert torch.allclose(full.logits, shared.logits, atol=1e-5)
    assert full.loss.item() == pytest.approx(shared.loss.item(), abs=1e-6)
    # A frozen tower's outputs, computed once per file, give the same inputs.
    from epd.train.trainer import _tower_outputs

    with torch.no_grad():
        frozen = model(**shared_vision_inputs(model, batch, media, 0, _tower_outputs(model, media, 2))[0])
    assert torch.allclose(frozen.logits, shared.logits, atol=1e-5)
    # A wrong clip in the batch changes the answer logits: the embeddings land per question.
    swapped = list(batch)
    other_clip = next(i for i, m in enumerate(media) if m.modality == "video" and i != batch[0].media_index)
    swapped[0] = type(batch[0])(**{**batch[0].__dict__, "media_index": other_clip})
    with torch.no_grad():
        other = model(**shared_vision_inputs(model, swapped, media, pad_id=0)[0])
    assert not torch.allclose(other.logits[0], shared.logits[0], atol=1e-4)


def test_compact_parallel_preparation_equals_the_plain_one(prepared, train_root):
    """uint8 patches prepared in 2 spawned processes give the same examples and float32 patches
    as one process keeping float32."""
    from epd.train.prepare import load_split

    adapter, examples, media = prepared
    data_dir, model_dir = train_root / "data", train_root / "model"
    ex2, media2 = load_split(
        data_dir,
        "train",
        adapter,
        progress=False,
        compact=True,
        workers=2,
        model_dir=model_dir,
        min_files_per_worker=1,
    )
    assert len(ex2) == len(examples) and len(media2) == len(media)
    for a, b in zip(examples, ex2):
        assert a.media_index == b.media_index and a.answer == b.answer and a.question_type == b.question_type
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        assert torch.equal(a.labels, b.labels)
    for a, b in zip(media, media2):
        assert b.patches.dtype == torch.uint8 and a.grid_thw == b.grid_thw
        assert torch.equal(a.pixel_values(), b.pixel_values())
    with pytest.raises(ValueError, match="needs model_dir"):
        load_split(data_dir, "train", adapter, progress=False, workers=2, min_files_per_worker=1)
