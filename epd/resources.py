"""Files epd ships beside its code: the trained demo model (models/) and the bundled samples (samples/).

They are top-level folders of the repository, reached as epd/models and epd/samples (symlinks in a
checkout, package data in the wheel; see pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """Directory `name` ("models" or "samples") of the installed package or checkout."""
    return (_PACKAGE / name).resolve()  # a checkout: the top-level folder the symlink names


def sample_video() -> Path:
    return shipped("samples") / "sample.mp4"


def demo_model_dir() -> Path:
    return shipped("models") / "epd-tiny-videoqa"
