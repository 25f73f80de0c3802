"""The settings of one training run (`TrainConfig`) and of the model it builds (`ModelSize`); their
defaults are the run that made the shipped models/epd-tiny-videoqa (DEFAULT_OUT)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.resources import demo_model_dir

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
