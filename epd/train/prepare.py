"""The training data, prepared with the serving path's own code: the synthetic dataset (built with
`python -m epd.synth.dataset`), each media file decoded with the encoder service's default sampling
and preprocessed by the serving adapter (`MediaItem`), each question tokenized with the adapter's
prompt and its answer (`Example`); in several processes (`load_split`), and kept in a file between
runs (`load_prepared`, `save_prepared`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from epd.stages.messages import question_messages, to_chat_template
from epd.train.aux_targets import TokenTargets, token_targets
from epd.train.config import TrainConfig
from epd.train.model import serving_adapter
from epd.train.pixel_codes import PixelCodec


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
    # Plain dicts, not the dataclasses: a pickle names each class's module, so a prepared file
    # would stop loading when the class moves (it lived in the script run as __main__ before).
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


def load_prepared(path: Path | None, key: str) -> dict | None:
    """Prepared splits saved by an earlier run on the same data and tokenizer, else None."""
    if path is None or not path.exists():
        return None
    saved = torch.load(path, weights_only=False)
    if saved.get("key") != key or "splits" not in saved:  # other data, or an older layout
        return None
    return {split: _from_plain(plain) for split, plain in saved["splits"].items()}


def save_prepared(path: Path, key: str, splits: dict) -> None:
    torch.save({"key": key, "splits": {split: _to_plain(v) for split, v in splits.items()}}, path)
