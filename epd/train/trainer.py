"""The two phases of training (`pretrain_vision`: the vision tower and the auxiliary head alone;
`train`: the whole model, which also prepares the data first and saves the model, its card, the
training log and the loss curve), their learning-rate schedule and parameter groups."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from epd.train.accuracy import evaluate, format_accuracy, overall
from epd.train.augment import mirrored_answer_ids
from epd.train.aux_targets import AuxHead, TokenTargets
from epd.train.batches import mirror_media, shared_vision_inputs, step_inputs
from epd.train.config import TrainConfig
from epd.train.model import model_spec, save_model, serving_adapter
from epd.train.prepare import (
    Example,
    MediaItem,
    check_chat_template,
    load_prepared,
    load_split,
    save_prepared,
    serving_sampling,
)

_FAMILY_NAMES = {"qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL"}


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
        cached = load_prepared(prepared_cache, key)
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
                save_prepared(prepared_cache, key, cached)
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
