"""The embedded default model: found in the package, or built once and cached on disk.

Order: $EPD_DEFAULT_MODEL (a directory), the trained demo model shipped in `models/` of the
repository, else a tiny randomly initialised Qwen2-VL built under $EPD_CACHE_DIR (default
~/.cache/epd). Concurrent first starts (three services at once) are safe: each builds into a
private directory and renames it into place; the loser discards its copy.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from epd.resources import demo_model_dir

RANDOM_MODEL_NAME = "tiny-qwen2-vl-random"
_SHIPPED = demo_model_dir()


def cache_dir() -> Path:
    return Path(os.environ.get("EPD_CACHE_DIR", Path.home() / ".cache" / "epd"))


def default_model_path() -> Path:
    """Directory of the default model, building it on first use."""
    if env := os.environ.get("EPD_DEFAULT_MODEL"):
        return Path(env)
    if (_SHIPPED / "config.json").exists():
        return _SHIPPED
    target = cache_dir() / "models" / RANDOM_MODEL_NAME
    if not (target / "config.json").exists():
        # torch only here: finding the shipped or cached model must not cost `epd serve` a torch import.
        from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        build_checkpoint(tmp, TinyVLMSpec())
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def accuracy_notice(path: str | Path) -> str:
    """For a demo model whose card records its test accuracy: a line saying how often it is right."""
    card = Path(path) / "epd_model_card.json"
    if not card.exists():
        return ""
    accuracy = json.loads(card.read_text()).get("accuracy", {}).get("test")
    if accuracy is None:
        return ""
    return (
        f"epd's demo model answers about {accuracy:.0%} of its synthetic test questions correctly "
        f"(per question type: {card})"
    )


def is_meaningless(path: str | Path) -> bool:
    """True for randomly initialised models, whose answers mean nothing."""
    card = Path(path) / "epd_model_card.json"
    if not card.exists():
        return False
    return "meaningless" in json.loads(card.read_text()).get("note", "")
