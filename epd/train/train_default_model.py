"""Train epd's default model: a tiny Qwen2-VL that answers the synthetic video-QA questions.

    PYTHONPATH=. python -m epd.train.train_default_model --out models/epd-tiny-videoqa

1. Builds the dataset with `python -m epd.synth.dataset` into a temporary directory (or reads
   `--data DIR` built before with the same sizes).
2. Builds the tokenizer (the synth question words included), processor and a
   `Qwen2VLForConditionalGeneration` with transformers' own initialisation (epd.model_runtime.tiny_model).
3. Prepares every input with the serving path's own code: frames from
   `epd.video.simple_decoder.decode` with the server's default `SamplingOptions` (2 fps, at most 32
   frames: 6 frames of a 3 s clip), pixels from `Qwen2VLAdapter.preprocess` (the video processor
   with `do_sample_frames=False`), token ids and M-RoPE positions from `Qwen2VLAdapter.build_prompt`
   (the processor's chat template). The loss is on the answer's tokens and the closing <|im_end|>.
4. Trains with AdamW (warm-up, cosine decay) on (clip, question) pairs drawn in a seeded order,
   with a tqdm bar; checks per-type accuracy on the validation split as it goes.
5. Saves model + processor with `save_pretrained`, `epd_model_card.json`, `training_log.json`
   and `loss_curve.png` under `--out`.

Accuracy here is greedy exact match computed in one teacher-forced forward pass: greedy decoding
produces exactly "answer<|im_end|>" if and only if every one of those tokens is the argmax given
the ones before it. `epd bench quality` measures the same thing through the serving pipeline.

`--family qwen3_vl` builds and trains a Qwen3-VL of the same sizes the same way instead (inputs
from `Qwen3VLAdapter`; `--out` required); see epd/train/README.md, "Other families".

Reproducible: the same seed, sizes and thread count give the same weights (CPU float32).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from epd.resources import demo_model_dir
from epd.stages.messages import question_messages, to_chat_template
from epd.train.augment import (
    mirror_answer,
    mirror_pixels,
    mirror_sequence,
    mirror_targets,
    mirrored_answer_ids,
)
from epd.train.aux_targets import AuxHead, TokenTargets, token_targets
from epd.train.pixel_codes import PixelCodec

DEFAULT_OUT = demo_model_dir()


@dataclass(frozen=True)
class ModelSize:
    """Sizes of the trained model (see epd.model_runtime.tiny_model.TinyVLMSpec)."""

    hidden_size: int = 128
    """Language model width; also the width the vision merger projects to."""
    intermediate_size: int = 256
    """Language model MLP width."""
    num_hidden_layers: int = 2
    """Language model decoder layers."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_depth: int = 4
    """Vision transformer blocks: the questions need vision far more than language."""
    vision_embed_dim: int = 128
    vision_num_heads: int = 4
    init: str = "scaled"
    """"scaled": matrices drawn with std `weight_std` (TinyVLMSpec); "hf": transformers' own
    initialisation (std 0.02). With "hf" the model sat on the answer prior (~35%) for 30k+
    questions in our runs; the larger init left that plateau sooner."""
    weight_std: float = 0.1
    """Std of the matrices when init is "scaled"."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run. The defaults are the run that made models/epd-tiny-videoqa."""

    family: str = "qwen2_vl"
    """Model family: "qwen2_vl" (the default model) or "qwen3_vl" (a Qwen3-VL of the same sizes,
    trained the same way; see epd/train/README.md, "Other families")."""
    seed: int = 0
    """Seeds the weights and the order of training examples."""
    num_train_clips: int = 8000
    """Training clips (plus one still image for every ten clips, synth's default ratio)."""
    num_validation_clips: int = 200
    """Validation clips, evaluated every `eval_every_steps`."""
    num_test_clips: int = 500
    """Test clips, evaluated once at the end (the same split `epd bench quality` uses)."""
    steps: int = 6000
    """Optimizer steps."""
    clips_per_step: int = 4
    """Media files per step; every question about them is in the step (about 8 per clip), and the
    vision tower runs once per file for all of them (its cost dominates a step)."""
    lr: float = 2e-3
    """Peak learning rate (after warm-up)."""
    min_lr_ratio: float = 0.05
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 200
    """Linear warm-up from 0 to lr."""
    weight_decay: float = 0.01
    """AdamW decay on matrices (not on biases and norms)."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    aux_weight: float = 1.0
    """Weight of the dense auxiliary loss on the vision tower's tokens (epd/train/aux_targets.py);
    0 trains on the answers alone."""
    vision_pretrain_steps: int = 3000
    """Phase 1: steps that train the vision tower and the auxiliary head alone, before the whole
    model trains (needs aux_weight > 0). A vision-only step costs a fraction of a full one, and
    seeing shapes and motion is what the answers cannot teach quickly."""
    vision_pretrain_lr: float = 1e-3
    """Peak learning rate of phase 1 (warm-up, then cosine decay like phase 2)."""
    vision_pretrain_clips: int = 8
    """Media files per phase-1 step."""
    vision_lr_scale: float = 1.0
    """Phase 2 trains the vision tower at lr * vision_lr_scale: at the full rate the first
    steps undo much of what phase 1 learnt (the auxiliary loss jumped from 0.16 to ~0.5). 0
    freezes it: its output per file is computed once and phase 2 trains the language model
    (and the merger's projection, part of the tower, stays as phase 1 left it) alone."""
    mirror_prob: float = 0.5
    """Chance that a training clip is seen mirrored left-right in a step (both phases; see
    epd/train/augment.py): a second view of every clip against overfitting the training clips."""
    eval_every_steps: int = 1000
    """Validation accuracy every this many steps (0: only at the end)."""
    prepare_workers: int = 2
    """Processes that decode and preprocess the splits before training (one per core); the
    prepared inputs do not depend on it."""
    num_threads: int = 2
    """torch threads (one per core of the 2-core machine the shipped model was trained on). The
    same seed, sizes and thread count give the same weights."""
    size: ModelSize = field(default_factory=ModelSize)
    """Model sizes."""


# -- data ----------------------------------------------------------------------------------------


@dataclass
class Example:
    """One (media, question, answer) as model inputs; tensors are 1-D over the sequence."""

    media_index: int
    input_ids: torch.Tensor  # [L] prompt + answer + <|im_end|>
    position_ids: torch.Tensor  # [4, L] text row + M-RoPE rows, as the serving path builds them
    labels: torch.Tensor  # [L] -100 except the answer tokens and <|im_end|>
    question_type: str
    answer: str


@dataclass
class MediaItem:
    """Preprocessed pixels of one clip or image, exactly as the encoder service makes them."""

    modality: str  # "video" | "image"
    patches: torch.Tensor
    """[num_patches, 3 * 2 * 14 * 14]: the processor's float32 patches, or their uint8 values
    when `codec` is set (epd/train/pixel_codes.py: 4x less memory)."""
    grid_thw: tuple[int, int, int]
    aux: TokenTargets | None = None  # per merged token, from the scene (training only)
    codec: PixelCodec | None = None

    def pixel_values(self) -> torch.Tensor:
        """The processor's float32 patches, [num_patches, 3 * 2 * 14 * 14]."""
        return self.patches if self.codec is None else self.codec.decode(self.patches)


def generate_dataset(out_dir: Path, config: TrainConfig) -> None:
    """Run `python -m epd.synth.dataset` (a subprocess: the same command a user would run)."""
    cmd = [
        sys.executable,
        "-m",
        "epd.synth.dataset",
        "--out",
        str(out_dir),
        "--num-train",
        str(config.num_train_clips),
        "--num-validation",
        str(config.num_validation_clips),
        "--num-test",
        str(config.num_test_clips),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)


def check_dataset(data_dir: Path, config: TrainConfig) -> None:
    """Refuse a --data directory built with other sizes than the config asks for."""
    info = json.loads((data_dir / "dataset_info.json").read_text())
    want = {
        "train": config.num_train_clips,
        "validation": config.num_validation_clips,
        "test": config.num_test_clips,
    }
    if info["num_videos"] != want:
        raise ValueError(
            f"{data_dir} holds {info['num_videos']} clips, this run wants {want}; rebuild it or drop --data"
        )


def serving_sampling():
    """The encoder service's default sampling (2 fps, at most 32 frames)."""
    from epd.encoder_svc.config import EncoderConfig

    return EncoderConfig().sampling


def scene_config(data_dir: Path):
    """The SceneConfig the dataset was generated with."""
    from epd.synth.scene import SceneConfig

    return SceneConfig(**json.loads((data_dir / "dataset_info.json").read_text())["scene"])


MIN_FILES_PER_PREPARE_WORKER = 50


def load_split(
    data_dir: Path,
    split: str,
    adapter,
    progress: bool = True,
    with_aux: bool = False,
    compact: bool = False,
    workers: int = 1,
    model_dir: Path | None = None,
    min_files_per_worker: int = MIN_FILES_PER_PREPARE_WORKER,
) -> tuple[list[Example], list[MediaItem]]:
    """Decode, preprocess and tokenize every question of `split` the way the serving path does;
    with_aux: also the dense targets of every media file (remade from its scene seed); compact:
    keep the patches as uint8 (epd/train/pixel_codes.py). workers > 1 prepares contiguous parts of
    the split in that many spawned processes (at most one per `min_files_per_worker` media files), each with the serving adapter loaded from
    `model_dir` (the checkpoint `adapter` came from); the result is the same as with one."""
    from epd.synth.manifest import read_manifest

    records = read_manifest(data_dir, split=split)
    # A spawned worker spends ~5 s importing torch and transformers and loading the adapter, and a
    # media file takes ~0.1 s to prepare: below ~50 files per worker, one process is faster.
    num_files = len({r.media for r in records})
    workers = min(workers, max(1, num_files // min_files_per_worker))
    if workers <= 1:
        return _prepare_records(records, data_dir, adapter, progress, with_aux, compact, f"preparing {split}")
    if model_dir is None:
        raise ValueError("preparing in several processes needs model_dir, the adapter's checkpoint")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # Cut between media files (a file's questions are consecutive in the manifest), at about
    # equal numbers of files per part.
    starts = [i for i, r in enumerate(records) if i == 0 or r.media != records[i - 1].media]
    bounds = [starts[len(starts) * k // workers] for k in range(workers)] + [len(records)]
    parts = [records[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    examples: list[Example] = []
    media: list[MediaItem] = []
    with (
        tempfile.TemporaryDirectory(prefix="epd-prepare-") as tmp,
        ProcessPoolExecutor(len(parts), mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        futures = [
            pool.submit(
                _prepare_part,
                part,
                data_dir,
                model_dir,
                Path(tmp) / f"{k}.pt",
                progress and k == 0,
                with_aux,
                compact,
                f"preparing {split} (part 1 of {len(parts)} in parallel)",
            )
            for k, part in enumerate(parts)
        ]
        for future in futures:  # in order, so the split keeps the manifest's order
            part_ex, part_media = _from_plain(torch.load(future.result(), weights_only=False))
            for e in part_ex:
                e.media_index += len(media)
            examples += part_ex
            media += part_media
    return examples, media


def _prepare_part(
    records: list,
    data_dir: Path,
    model_dir: Path,
    out: Path,
    progress: bool,
    with_aux: bool,
    compact: bool,
    desc: str,
) -> Path:
    """One process's part of `load_split`: prepared with its own adapter, saved to `out`."""
    torch.set_num_threads(1)
    adapter = serving_adapter(model_dir)
    torch.save(
        _to_plain(_prepare_records(records, data_dir, adapter, progress, with_aux, compact, desc)), out
    )
    return out


def _to_plain(split: tuple[list[Example], list[MediaItem]]) -> tuple[list[dict], list[dict]]:
    # Plain dicts: pickled dataclasses would be bound to the module that ran (__main__).
    examples, media = split
    return [vars(e) for e in examples], [vars(m) for m in media]


def _from_plain(plain: tuple[list[dict], list[dict]]) -> tuple[list[Example], list[MediaItem]]:
    examples, media = plain
    return [Example(**e) for e in examples], [MediaItem(**m) for m in media]


def _prepare_records(
    records: list, data_dir: Path, adapter, progress: bool, with_aux: bool, compact: bool, desc: str
) -> tuple[list[Example], list[MediaItem]]:
    from tqdm import tqdm

    from epd.model_runtime.adapter import VisualMeta
    from epd.synth.scene import generate_image_scene, generate_scene
    from epd.video.simple_decoder import decode

    sampling = serving_sampling()
    scenes = scene_config(data_dir) if with_aux else None
    codecs = (
        {
            "video": PixelCodec.of(adapter.processor.video_processor),
            "image": PixelCodec.of(adapter.processor.image_processor),
        }
        if compact
        else {}
    )
    media: list[MediaItem] = []
    metas: list[VisualMeta] = []
    index_of: dict[str, int] = {}
    examples: list[Example] = []
    end_ids = adapter.tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]
    # The clips share one layout and a few hundred (question, answer) pairs: tokenize each once.
    sequences: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for r in tqdm(records, desc=desc, unit="question", disable=not progress, mininterval=2):
        if r.media not in index_of:
            video = decode(r.media_path(data_dir).read_bytes(), sampling)
            inputs = adapter.preprocess(video)
            meta = VisualMeta(
                inputs.modality,
                inputs.grid_thw,
                inputs.second_per_grid_t,
                adapter.num_visual_tokens(inputs.grid_thw),
                inputs.group_timestamps_s,
            )
            aux = None
            if scenes is not None:
                if r.media_type == "video":
                    scene = generate_scene(r.seed, scenes)
                    frame_indices = [int(round(ts * scenes.fps)) for ts in video.timestamps_s]
                else:
                    scene, frame_indices = generate_image_scene(r.seed, scenes), [0]
                aux = token_targets(scene, frame_indices, inputs.grid_thw)
            codec = codecs.get(inputs.modality)
            patches = inputs.pixel_values if codec is None else codec.encode(inputs.pixel_values)
            index_of[r.media] = len(media)
            media.append(MediaItem(inputs.modality, patches, inputs.grid_thw, aux, codec))
            metas.append(meta)
        i = index_of[r.media]
        key = (r.question, r.answer, metas[i])
        if key not in sequences:
            sequences[key] = _sequence(adapter, r.question, r.answer, metas[i], end_ids)
        examples.append(Example(i, *sequences[key], r.question_type, r.answer))
    return examples, media


def _sequence(
    adapter, question: str, answer: str, meta, end_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [L], position_ids [4, L] and labels [L] of one question and answer about a media
    file with visual layout `meta` (the serving adapter's prompt, then the answer)."""
    # The serving prompt of a question: one user message [media, question].
    prompt = adapter.build_prompt(to_chat_template(question_messages(question), meta.modality), meta)
    answer_ids = adapter.tokenizer(answer, add_special_tokens=False)["input_ids"] + end_ids
    input_ids = torch.cat([prompt.input_ids[0], torch.tensor(answer_ids, dtype=torch.long)])
    positions = adapter._prompt_positions(input_ids[None], meta)[:, 0]  # [4, L]
    if not torch.equal(positions[:, : prompt.num_tokens], prompt.position_ids[:, 0]):
        raise AssertionError("answer tokens changed the prompt's positions")
    labels = torch.full_like(input_ids, -100)
    labels[prompt.num_tokens :] = input_ids[prompt.num_tokens :]
    return input_ids, positions, labels


def check_chat_template(adapter) -> None:
    """The supervised tokens must be what the processor's chat template writes for the answer."""
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "what colour is the circle?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "yellow"}]},
    ]
    text = adapter.processor.apply_chat_template(messages, tokenize=False)
    prompt = adapter.processor.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    if text != prompt + "yellow<|im_end|>\n":
        raise AssertionError(f"chat template renders the answer turn unexpectedly: {text[len(prompt) :]!r}")


def collate(batch: list[Example], media: list[MediaItem], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded model inputs; visual inputs concatenated in batch order (the model scatters
    them into the placeholders in that order)."""
    length = max(len(e.input_ids) for e in batch)
    n = len(batch)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    positions = torch.zeros((4, n, length), dtype=torch.long)
    video_pix, video_grid, image_pix, image_grid = [], [], [], []
    for row, e in enumerate(batch):
        L = len(e.input_ids)
        input_ids[row, :L] = e.input_ids
        labels[row, :L] = e.labels
        attention[row, :L] = 1
        positions[:, row, :L] = e.position_ids
        positions[:, row, L:] = e.position_ids[:, -1:] + torch.arange(1, length - L + 1)
        m = media[e.media_index]
        if m.modality == "video":
            video_pix.append(m.pixel_values())
            video_grid.append(m.grid_thw)
        else:
            image_pix.append(m.pixel_values())
            image_grid.append(m.grid_thw)
    out = {"input_ids": input_ids, "attention_mask": attention, "position_ids": positions, "labels": labels}
    if video_pix:
        out["pixel_values_videos"] = torch.cat(video_pix)
        out["video_grid_thw"] = torch.tensor(video_grid, dtype=torch.long)
    if image_pix:
        out["pixel_values"] = torch.cat(image_pix)
        out["image_grid_thw"] = torch.tensor(image_grid, dtype=torch.long)
    return out


def shared_vision_inputs(
    model,
    batch: list[Example],
    media: list[MediaItem],
    pad_id: int,
    frozen: list[torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
    """Model inputs with the visual embeddings already in place, the vision tower run once per
    distinct media file of the batch (several questions share a clip).

    The same computation as `model(**collate(batch))`, where the model runs the tower once per
    question: the tower sees one file at a time (attention within a temporal patch group), and
    the embeddings go into the placeholder tokens in batch order. Also returns the tower's output
    [sum of merged tokens, hidden] and the media indices it covers, in order. frozen: the tower's
    output per media file, computed once (a frozen tower), used instead of running it."""
    inputs = collate(batch, [MediaItem(m.modality, m.patches[:0], m.grid_thw) for m in media], pad_id)
    for key in ("pixel_values_videos", "pixel_values", "video_grid_thw", "image_grid_thw"):
        inputs.pop(key, None)
    distinct = sorted({e.media_index for e in batch})
    if frozen is not None:
        per_media = {i: frozen[i] for i in distinct}
        visual = torch.cat([frozen[i] for i in distinct])
    else:
        pixels = torch.cat([media[i].pixel_values() for i in distinct])
        grids = torch.tensor([media[i].grid_thw for i in distinct], dtype=torch.long)
        out = model.model.visual(pixels, grid_thw=grids)
        visual = out.pooler_output  # [sum tokens, hidden]
        sizes = [int(t * h * w) // 4 for t, h, w in grids.tolist()]
        per_media = dict(zip(distinct, torch.split(visual, sizes)))
        deepstack = getattr(out, "deepstack_features", None)  # Qwen3-VL only
        if deepstack:
            inputs.update(
                _deepstack_inputs(
                    batch, media, per_media, [dict(zip(distinct, torch.split(d, sizes))) for d in deepstack]
                )
            )
            return inputs, visual, distinct
    input_ids = inputs.pop("input_ids")
    embeds = model.model.get_input_embeddings()(input_ids)  # [B, L, hidden]
    cfg = model.config
    mask = (input_ids == cfg.video_token_id) | (input_ids == cfg.image_token_id)
    fill = torch.cat([per_media[e.media_index] for e in batch])
    inputs["inputs_embeds"] = embeds.masked_scatter(mask[..., None].expand_as(embeds), fill)
    return inputs, visual, distinct


def _deepstack_inputs(
    batch: list[Example],
    media: list[MediaItem],
    per_media: dict[int, torch.Tensor],
    deepstack: list[dict[int, torch.Tensor]],
) -> dict:
    """Qwen3-VL's part of `shared_vision_inputs`: the tower's output and its DeepStack features
    (one per `deepstack_visual_indexes` layer, row for row with the output) given to the model as
    `mm_encoder_outputs`, one entry per question in batch order, per modality, as its own forward
    would have computed them; the model puts them in place (embeddings into the placeholders,
    DeepStack features added after its first language layers)."""
    from types import SimpleNamespace

    out = {}
    for modality in ("video", "image"):
        rows = [e.media_index for e in batch if media[e.media_index].modality == modality]
        if rows:
            out[modality] = SimpleNamespace(
                pooler_output=[per_media[i] for i in rows],
                deepstack_features=[[d[i] for i in rows] for d in deepstack],
            )
    return {"mm_encoder_outputs": out}


@torch.no_grad()
def evaluate(
    model, examples: list[Example], media: list[MediaItem], pad_id: int, batch_size: int = 32
) -> dict[str, tuple[int, int]]:
    """{question_type: (correct, total)}: greedy exact match, teacher-forced (module docstring)."""
    model.eval()
    correct: Counter = Counter()
    total: Counter = Counter()
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        inputs = collate(batch, media, pad_id)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits  # [B, L, vocab]
        predicted = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        supervised = target != -100
        ok = ((predicted == target) | ~supervised).all(dim=1)
        for e, good in zip(batch, ok.tolist()):
            total[e.question_type] += 1
            correct[e.question_type] += int(good)
    model.train()
    return {t: (correct[t], total[t]) for t in sorted(total)}


def overall(by_type: dict[str, tuple[int, int]]) -> float:
    c = sum(v[0] for v in by_type.values())
    n = sum(v[1] for v in by_type.values())
    return c / max(n, 1)


def format_accuracy(by_type: dict[str, tuple[int, int]]) -> str:
    parts = [f"{t} {c / n:.0%}" for t, (c, n) in by_type.items()]
    return f"overall {overall(by_type):.1%} | " + ", ".join(parts)


# -- model ---------------------------------------------------------------------------------------


TRAINABLE_FAMILIES = ("qwen2_vl", "qwen3_vl")
_FAMILY_NAMES = {"qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL"}


def deepstack_layers(config: TrainConfig) -> tuple[int, ...]:
    """Qwen3-VL: the tower layers whose features DeepStack adds to the first language layers: the
    layers just before the last, one per language layer (at most 3, as the hub's models)."""
    n = min(config.size.num_hidden_layers, 3, config.size.vision_depth - 1)
    return tuple(range(config.size.vision_depth - 1 - n, config.size.vision_depth - 1))


def model_spec(config: TrainConfig):
    from epd.model_runtime.tiny_model import TinyVLMSpec
    from epd.synth.questions import tokenizer_words

    if config.family not in TRAINABLE_FAMILIES:
        raise ValueError(f"the trainer builds {' or '.join(TRAINABLE_FAMILIES)}, not {config.family!r}")
    s = config.size
    extra = {"deepstack_visual_indexes": deepstack_layers(config)} if config.family == "qwen3_vl" else {}
    return TinyVLMSpec(
        family=config.family,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads,
        vision_depth=s.vision_depth,
        vision_embed_dim=s.vision_embed_dim,
        vision_num_heads=s.vision_num_heads,
        seed=config.seed,
        init=s.init,
        weight_std=s.weight_std,
        extra_words=tuple(tokenizer_words()),
        **extra,
    )


def serving_adapter(model_dir: Path):
    """The serving adapter of the checkpoint's family (vision part only): it prepares every input."""
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import check_model_dir

    adapter_cls: type
    if check_model_dir(str(model_dir)) == "qwen3_vl":
        from epd.model_runtime.qwen3_vl import Qwen3VLAdapter as adapter_cls
    else:
        from epd.model_runtime.qwen2_vl import Qwen2VLAdapter as adapter_cls
    return adapter_cls(str(model_dir), ModelConfig(), {"vision"})


def save_model(model, processor, out_dir: Path) -> None:
    tok = processor.tokenizer
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def lr_at(step: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _load_prepared(path: Path | None, key: str) -> dict | None:
    """Prepared splits saved by an earlier run on the same data and tokenizer, else None."""
    if path is None or not path.exists():
        return None
    saved = torch.load(path, weights_only=False)
    if saved.get("key") != key or "splits" not in saved:  # other data, or an older layout
        return None
    return {split: _from_plain(plain) for split, plain in saved["splits"].items()}


def _save_prepared(path: Path, key: str, splits: dict) -> None:
    torch.save({"key": key, "splits": {split: _to_plain(v) for split, v in splits.items()}}, path)


def _optimizer_step(optimizer, loss: torch.Tensor, params: list, grad_clip: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()


def _mean_every_10(values: list[float]) -> list[float]:
    """The mean of each run of 10 values (the last run may be shorter), for the training log."""
    return [round(sum(values[i : i + 10]) / len(values[i : i + 10]), 5) for i in range(0, len(values), 10)]


def _param_groups(model, aux_head: AuxHead, config: TrainConfig) -> list[dict]:
    """AdamW groups of phase 2: decay on matrices only; the vision tower (and the auxiliary head
    that reads it) at `vision_lr_scale` times the rate of the rest."""
    vision = {id(p) for p in model.model.visual.parameters()} | {id(p) for p in aux_head.parameters()}
    params = list(model.parameters()) + (list(aux_head.parameters()) if config.aux_weight > 0 else [])
    groups = []
    for is_vision in (False, True) if config.vision_lr_scale > 0 else (False,):
        for decay in (True, False):
            chosen = [p for p in params if (id(p) in vision) == is_vision and (p.dim() >= 2) == decay]
            if chosen:
                groups.append(
                    {
                        "params": chosen,
                        "weight_decay": config.weight_decay if decay else 0.0,
                        "lr_scale": config.vision_lr_scale if is_vision else 1.0,
                    }
                )
    return groups


@torch.no_grad()
def _tower_outputs(model, media: list[MediaItem], batch_size: int = 32) -> list[torch.Tensor]:
    """The vision tower's output per media file, [merged tokens, hidden] each."""
    out: list[torch.Tensor] = []
    for start in range(0, len(media), batch_size):
        chunk = media[start : start + batch_size]
        grids = torch.tensor([m.grid_thw for m in chunk], dtype=torch.long)
        visual = model.model.visual(
            torch.cat([m.pixel_values() for m in chunk]), grid_thw=grids
        ).pooler_output
        out += torch.split(visual, [int(t * h * w) // 4 for t, h, w in grids.tolist()])
    return out


def _coin_flips(n: int, prob: float, gen: torch.Generator) -> list[bool]:
    """n seeded coin flips; draws nothing when prob is 0 (runs without mirroring stay as before)."""
    return (torch.rand(n, generator=gen) < prob).tolist() if prob > 0 else [False] * n


def mirror_media(m: MediaItem) -> MediaItem:
    return MediaItem(
        m.modality,
        mirror_pixels(m.patches, m.grid_thw),
        m.grid_thw,
        None if m.aux is None else mirror_targets(m.aux, m.grid_thw),
        m.codec,
    )


def step_inputs(
    idx: list[int],
    flips: list[bool],
    questions_of: dict[int, list[Example]],
    media: list[MediaItem],
    answer_ids: dict[str, torch.Tensor],
) -> tuple[list[Example], list[MediaItem]]:
    """The examples and media of one phase-2 step, renumbered 0..len(idx)-1, the flipped clips
    mirrored with their answers."""
    batch: list[Example] = []
    local: list[MediaItem] = []
    for j, (i, flip) in enumerate(zip(idx, flips)):
        local.append(mirror_media(media[i]) if flip else media[i])
        for e in questions_of[i]:
            if flip:
                ids, positions, labels = mirror_sequence(
                    e.input_ids, e.position_ids, e.labels, e.answer, answer_ids
                )
                batch.append(Example(j, ids, positions, labels, e.question_type, mirror_answer(e.answer)))
            else:
                batch.append(Example(j, e.input_ids, e.position_ids, e.labels, e.question_type, e.answer))
    return batch, local


def pretrain_vision(
    model, aux_head: AuxHead, media: list[MediaItem], config: TrainConfig, progress: bool = True
) -> list[float]:
    """Phase 1: the vision tower and the auxiliary head alone, on random media files; returns the
    loss per step. The language model is untouched (its weights get no gradient)."""
    from tqdm import tqdm

    visual = model.model.visual
    params = list(visual.parameters()) + list(aux_head.parameters())
    optimizer = torch.optim.AdamW(
        params, lr=config.vision_pretrain_lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
    )
    phase = TrainConfig(
        steps=config.vision_pretrain_steps,
        lr=config.vision_pretrain_lr,
        warmup_steps=min(config.warmup_steps, max(1, config.vision_pretrain_steps // 10)),
        min_lr_ratio=config.min_lr_ratio,
    )
    gen = torch.Generator().manual_seed(config.seed + 1)
    losses: list[float] = []
    bar = tqdm(
        range(config.vision_pretrain_steps),
        desc="vision pretraining",
        unit="step",
        disable=not progress,
        mininterval=2,
    )
    for step in bar:
        idx = torch.randint(len(media), (config.vision_pretrain_clips,), generator=gen).tolist()
        flips = _coin_flips(len(idx), config.mirror_prob, gen)
        chosen = [mirror_media(media[i]) if f else media[i] for i, f in zip(idx, flips)]
        pixels = torch.cat([m.pixel_values() for m in chosen])
        grids = torch.tensor([m.grid_thw for m in chosen], dtype=torch.long)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, phase)
        tokens = visual(pixels, grid_thw=grids).pooler_output  # [sum merged tokens, hidden]
        loss = aux_head.loss(tokens, TokenTargets.cat([m.aux for m in chosen]))
        _optimizer_step(optimizer, loss, params, config.grad_clip)
        losses.append(float(loss.detach()))
        if step % 20 == 0:
            bar.set_postfix(aux=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}")
    bar.close()
    return losses


def train(
    config: TrainConfig,
    data_dir: Path,
    out_dir: Path,
    command: str,
    progress: bool = True,
    prepared_cache: Path | None = None,
) -> dict:
    """Train, save under `out_dir`, return the training log (also written as training_log.json).
    prepared_cache: a file to keep the decoded and tokenized splits in between runs (it is
    reused only if the dataset, tokenizer and model sizes match)."""
    from tqdm import tqdm

    from epd.model_runtime.tiny_model import build_model, build_processor
    from epd.train.png_plot import Series, line_plot

    torch.set_num_threads(config.num_threads)
    torch.manual_seed(config.seed)
    spec = model_spec(config)
    processor = build_processor(spec)
    model = build_model(spec, processor.tokenizer)
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    # The serving adapter, loaded from the untrained checkpoint, prepares every input.
    with tempfile.TemporaryDirectory(prefix="epd-init-") as init_dir:
        save_model(model, processor, Path(init_dir))
        adapter = serving_adapter(Path(init_dir))
        check_chat_template(adapter)
        t0 = time.perf_counter()
        key = json.dumps(
            {
                "data": (data_dir / "dataset_info.json").read_text(),
                # what the tokenizer and the processor are made from (not the model's sizes)
                "spec": {
                    k: getattr(spec, k)
                    for k in ("family", "vocab_size", "min_pixels", "max_pixels", "extra_words")
                },
                "aux": config.aux_weight > 0,
                "layout": "uint8 patches",
            },
            sort_keys=True,
            default=str,
        )
        cached = _load_prepared(prepared_cache, key)
        if cached is None:
            cached = {
                split: load_split(
                    data_dir,
                    split,
                    adapter,
                    progress,
                    with_aux=split == "train" and config.aux_weight > 0,
                    compact=True,
                    workers=config.prepare_workers,
                    model_dir=Path(init_dir),
                )
                for split in ("train", "validation", "test")
            }
            if prepared_cache is not None:
                _save_prepared(prepared_cache, key, cached)
        (train_ex, train_media), (val_ex, val_media), (test_ex, test_media) = (
            cached["train"],
            cached["validation"],
            cached["test"],
        )
        prepare_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"{num_params / 1e6:.2f} M parameters; {len(train_ex)} train, {len(val_ex)} validation, "
        f"{len(test_ex)} test questions (prepared in {prepare_s:.0f} s)",
        file=sys.stderr,
    )

    aux_head = AuxHead(model.config.text_config.hidden_size)  # trained alongside, never saved
    t_pre = time.perf_counter()
    pretrain_losses: list[float] = []
    if config.vision_pretrain_steps:
        if config.aux_weight <= 0:
            raise ValueError("vision pretraining trains on the auxiliary targets: set aux_weight > 0")
        pretrain_losses = pretrain_vision(model, aux_head, train_media, config, progress)
    pretrain_s = time.perf_counter() - t_pre
    groups = _param_groups(model, aux_head, config)
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98))
    frozen = None
    answer_ids = mirrored_answer_ids(processor.tokenizer)
    if config.vision_lr_scale == 0:
        if config.family != "qwen2_vl":
            raise ValueError("a frozen vision tower (vision_lr_scale 0) is implemented for qwen2_vl only")
        if config.mirror_prob > 0:
            raise ValueError("mirror_prob needs a trainable vision tower (vision_lr_scale > 0)")
        model.model.visual.requires_grad_(False)
        frozen = _tower_outputs(model, train_media)
    order_gen = torch.Generator().manual_seed(config.seed)
    order: list[int] = []
    questions_of: dict[int, list[Example]] = {}
    for e in train_ex:
        questions_of.setdefault(e.media_index, []).append(e)
    num_seen = 0
    losses: list[float] = []
    aux_losses: list[float] = []
    evals: list[dict] = []
    model.train()
    t_train = time.perf_counter()
    bar = tqdm(range(config.steps), desc="training", unit="step", disable=not progress, mininterval=2)
    for step in bar:
        if len(order) < config.clips_per_step:
            order += torch.randperm(len(train_media), generator=order_gen).tolist()
        idx, order = order[: config.clips_per_step], order[config.clips_per_step :]
        if frozen is None:
            flips = _coin_flips(len(idx), config.mirror_prob, order_gen)
            batch, step_media = step_inputs(idx, flips, questions_of, train_media, answer_ids)
        else:
            batch, step_media = [e for i in idx for e in questions_of[i]], train_media
        num_seen += len(batch)
        inputs, visual, distinct = shared_vision_inputs(model, batch, step_media, pad_id, frozen)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config) * group["lr_scale"]
        loss = model(**inputs).loss
        total = loss
        if config.aux_weight > 0 and frozen is None:
            aux = aux_head.loss(visual, TokenTargets.cat([step_media[i].aux for i in distinct]))
            total = loss + config.aux_weight * aux
            aux_losses.append(float(aux.detach()))
        _optimizer_step(optimizer, total, params, config.grad_clip)
        losses.append(float(loss.detach()))
        if step % 20 == 0:
            post = {"loss": f"{sum(losses[-50:]) / len(losses[-50:]):.3f}"}
            if aux_losses:
                post["aux"] = f"{sum(aux_losses[-50:]) / len(aux_losses[-50:]):.3f}"
            bar.set_postfix(post)
        last = step + 1 == config.steps
        if (config.eval_every_steps and (step + 1) % config.eval_every_steps == 0) or last:
            val = evaluate(model, val_ex, val_media, pad_id)
            evals.append({"step": step + 1, "validation": val, "overall": overall(val)})
            bar.write(f"step {step + 1}: validation {format_accuracy(val)}")
    bar.close()
    train_s = time.perf_counter() - t_train
    test = evaluate(model, test_ex, test_media, pad_id)
    print(f"test: {format_accuracy(test)}", file=sys.stderr)

    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(model, processor, out_dir)
    curve = out_dir / "loss_curve.png"
    line_plot(
        curve,
        [
            Series("loss per step", list(range(1, len(losses) + 1)), losses),
            Series("mean of 100 steps", list(range(1, len(losses) + 1)), smooth(losses, 100)),
        ],
        title=f"epd-tiny-videoqa training loss (seed {config.seed}, {config.clips_per_step} clips a step)",
        xlabel="step",
        ylabel="loss",
        log_y=True,
    )
    log = {
        "config": asdict(config),
        "num_parameters": num_params,
        "num_questions": {"train": len(train_ex), "validation": len(val_ex), "test": len(test_ex)},
        "num_media": {"train": len(train_media), "validation": len(val_media), "test": len(test_media)},
        "prepare_s": round(prepare_s, 1),
        "vision_pretrain_s": round(pretrain_s, 1),
        "vision_pretrain_loss_every_10_steps": _mean_every_10(pretrain_losses),
        "train_s": round(train_s, 1),
        "seconds_per_step": round(train_s / config.steps, 4),
        "num_questions_seen": num_seen,
        "loss_every_10_steps": _mean_every_10(losses),
        "aux_loss_every_10_steps": _mean_every_10(aux_losses),
        "validation": evals,
        "test": {"by_type": test, "overall": overall(test)},
    }
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    card = {
        "name": "epd-tiny-videoqa" if config.family == "qwen2_vl" else f"epd-tiny-videoqa-{config.family}",
        "built_by": "epd.train.train_default_model",
        "note": (
            f"a tiny {_FAMILY_NAMES[config.family]} trained from scratch on epd's synthetic video-QA "
            "data (synth/); it answers questions about coloured shapes in short clips with one word"
        ),
        "command": command,
        "seed": config.seed,
        "num_threads": config.num_threads,
        "num_parameters": num_params,
        "spec": {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(model_spec(config)).items()
            if k != "extra_words"
        },
        "data": {
            "generator": "python -m epd.synth.dataset",
            "num_clips": {
                "train": config.num_train_clips,
                "validation": config.num_validation_clips,
                "test": config.num_test_clips,
            },
            "num_media": log["num_media"],
            "num_questions": log["num_questions"],
            "sampling": {"fps": serving_sampling().fps, "max_frames": serving_sampling().max_frames},
        },
        "training": {
            "steps": config.steps,
            "clips_per_step": config.clips_per_step,
            "lr": config.lr,
            "aux_weight": config.aux_weight,
            "vision_pretrain_steps": config.vision_pretrain_steps,
            "vision_lr_scale": config.vision_lr_scale,
            "mirror_prob": config.mirror_prob,
            "vision_pretrain_s": round(pretrain_s, 1),
            "num_questions_seen": log["num_questions_seen"],
            "train_s": log["train_s"],
            "seconds_per_step": log["seconds_per_step"],
        },
        "accuracy": {
            "metric": "greedy exact match of the one-word answer",
            "validation": overall(evals[-1]["validation"]),
            "test": overall(test),
            "test_by_type": {t: round(c / n, 4) for t, (c, n) in test.items()},
            "test_counts": {t: [c, n] for t, (c, n) in test.items()},
        },
    }
    (out_dir / "epd_model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(
        f"saved {out_dir} ({sum(f.stat().st_size for f in out_dir.iterdir()) / 1e6:.1f} MB); "
        f"loss curve {curve}",
        file=sys.stderr,
    )
    return log


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m epd.train.train_default_model", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--out",
        default="",
        help=f"directory to save the model into (default for qwen2_vl: "
        f"{DEFAULT_OUT}; other families must name one)",
    )
    p.add_argument(
        "--family",
        default=d.family,
        choices=TRAINABLE_FAMILIES,
        help="model family to build and train (qwen3_vl: a Qwen3-VL of the same sizes)",
    )
    p.add_argument(
        "--data",
        default="",
        help="a dataset built by epd.synth.dataset with the same sizes "
        "(default: build one in a temporary directory)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--clips-per-step", type=int, default=d.clips_per_step)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--aux-weight",
        type=float,
        default=d.aux_weight,
        help="weight of the dense vision-token loss (0: answers only)",
    )
    p.add_argument(
        "--vision-pretrain-steps",
        type=int,
        default=d.vision_pretrain_steps,
        help="phase 1: steps on the vision tower + auxiliary head alone",
    )
    p.add_argument("--vision-pretrain-lr", type=float, default=d.vision_pretrain_lr)
    p.add_argument(
        "--vision-lr-scale",
        type=float,
        default=d.vision_lr_scale,
        help="phase 2 trains the vision tower at this fraction of --lr",
    )
    p.add_argument("--num-train", type=int, default=d.num_train_clips, help="training clips")
    p.add_argument("--num-validation", type=int, default=d.num_validation_clips, help="validation clips")
    p.add_argument("--num-test", type=int, default=d.num_test_clips, help="test clips")
    p.add_argument(
        "--mirror-prob",
        type=float,
        default=d.mirror_prob,
        help="chance a training clip is mirrored left-right in a step",
    )
    p.add_argument("--eval-every", type=int, default=d.eval_every_steps, help="steps between validations")
    p.add_argument("--threads", type=int, default=d.num_threads, help="torch threads")
    p.add_argument(
        "--prepare-workers",
        type=int,
        default=d.prepare_workers,
        help="processes that prepare the inputs before training",
    )
    s = ModelSize()
    p.add_argument("--hidden-size", type=int, default=s.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=s.intermediate_size)
    p.add_argument("--layers", type=int, default=s.num_hidden_layers)
    p.add_argument("--vision-depth", type=int, default=s.vision_depth)
    p.add_argument("--vision-dim", type=int, default=s.vision_embed_dim)
    p.add_argument("--vision-heads", type=int, default=s.vision_num_heads)
    p.add_argument("--init", default=s.init, choices=["hf", "scaled"])
    p.add_argument("--weight-std", type=float, default=s.weight_std)
    p.add_argument("--heads", type=int, default=s.num_attention_heads)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--prepared-cache",
        default="",
        help="file that keeps the prepared splits between "
        "runs on the same --data (skips ~3 minutes of decoding)",
    )
    a = p.parse_args(argv)
    size = ModelSize(
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.layers,
        vision_depth=a.vision_depth,
        vision_embed_dim=a.vision_dim,
        vision_num_heads=a.vision_heads,
        init=a.init,
        weight_std=a.weight_std,
        num_attention_heads=a.heads,
    )
    if not a.out:
        if a.family != "qwen2_vl":
            p.error(
                f"--family {a.family} needs --out (the default directory holds the shipped Qwen2-VL model)"
            )
        a.out = str(DEFAULT_OUT)
    config = TrainConfig(
        family=a.family,
        seed=a.seed,
        steps=a.steps,
        clips_per_step=a.clips_per_step,
        lr=a.lr,
        aux_weight=a.aux_weight,
        vision_pretrain_steps=a.vision_pretrain_steps,
        vision_pretrain_lr=a.vision_pretrain_lr,
        vision_lr_scale=a.vision_lr_scale,
        mirror_prob=a.mirror_prob,
        num_train_clips=a.num_train,
        num_validation_clips=a.num_validation,
        num_test_clips=a.num_test,
        eval_every_steps=a.eval_every,
        num_threads=a.threads,
        prepare_workers=a.prepare_workers,
        size=size,
        warmup_steps=min(d.warmup_steps, max(1, a.steps // 10)),
    )
    return config, a


def main(argv: list[str] | None = None) -> int:
    config, a = parse_args(argv)
    command = "PYTHONPATH=. python -m epd.train.train_default_model " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    tmp = None
    if a.data:
        data_dir = Path(a.data)
        check_dataset(data_dir, config)
    else:
        tmp = tempfile.mkdtemp(prefix="epd-synth-")
        data_dir = Path(tmp)
        generate_dataset(data_dir, config)
    try:
        train(
            config,
            data_dir,
            Path(a.out),
            command.strip(),
            progress=not a.no_progress,
            prepared_cache=Path(a.prepared_cache) if a.prepared_cache else None,
        )
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
