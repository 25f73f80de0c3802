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

Accuracy here is greedy exact match computed in one teacher-forced forward pass
(epd/train/accuracy.py says why that is the same); `epd bench quality` measures the same thing
through the serving pipeline.

This module is the command line; the run's settings are in epd/train/config.py, the model in
model.py, steps 1 and 3 in prepare.py, the batches in batches.py, steps 4 and 5 in trainer.py.

`--family qwen3_vl` builds and trains a Qwen3-VL of the same sizes the same way instead (inputs
from `Qwen3VLAdapter`; `--out` required); see epd/train/README.md, "Other families".

Reproducible: the same seed, sizes and thread count give the same weights (CPU float32).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from epd.train.config import DEFAULT_OUT, ModelSize, TrainConfig
from epd.train.model import TRAINABLE_FAMILIES
from epd.train.prepare import check_dataset, generate_dataset
from epd.train.trainer import train


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
