"""Load the adapter a stage needs, by the checkpoint's model type."""

from __future__ import annotations

import logging

import torch

from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.default_model import default_model_path

log = logging.getLogger(__name__)

# model_type in config.json -> adapter class; a new family is one entry here plus its file.
_FAMILIES = {"qwen2_vl", "qwen2_5_vl"}


def resolve_model_path(model: str) -> str:
    return str(default_model_path()) if model == "default" else model


def load_adapter(config: ModelConfig, stage: str) -> VLMAdapter:
    """stage: "encoder", "prefill", "decode" or "all" (embedded mode loads one model for all)."""
    from transformers import AutoConfig

    from epd.model_runtime.qwen2_vl import STAGE_PARTS, Qwen2VLAdapter

    torch.set_num_threads(config.num_threads)
    path = resolve_model_path(config.model)
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in _FAMILIES:
        raise ValueError(
            f"model {config.model!r} is a {model_type!r}; epd serves {sorted(_FAMILIES)} models"
        )
    parts = {"vision", "language"} if stage == "all" else STAGE_PARTS[stage]
    log.info("loading %s (%s) for %s on %s", path, model_type, stage, config.device)
    return Qwen2VLAdapter(path, config, parts)
