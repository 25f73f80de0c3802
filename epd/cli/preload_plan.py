"""What a process preloads before anything else (LD_PRELOAD): the shape of a plan, shared by the
allocator (`epd.cli.allocator`) and MKL's kernels (`epd.cli.mkl_dispatch`); `epd.cli.preload`
carries them out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PreloadPlan:
    """What `epd serve` does about one preloaded library before anything else."""

    exec_env: dict[str, str] | None = None
    """Run the process again with this environment (None: go on as it is)."""
    error: str | None = None
    """Exit 2 with this line (a library asked for by name that cannot be had)."""
    note: str | None = None
    """Say this once at INFO and go on."""


def preload_entries(environ: Mapping[str, str]) -> list[str]:
    """LD_PRELOAD's libraries, in order (the loader takes colons or spaces between them)."""
    return [entry for entry in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if entry]


def mapped_libraries(pid: int | str = "self") -> str:
    """The text of a process's memory map (empty where /proc has none)."""
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""
