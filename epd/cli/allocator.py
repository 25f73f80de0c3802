"""The model processes' memory allocator: tcmalloc when it is installed (`epd serve --allocator`).

Why: glibc's malloc keeps the memory of freed large tensors in the arena of the thread that
allocated them (its mmap threshold rises to the largest block freed, so later blocks of that size
come from the heap, not mmap, and a block freed by another thread returns to its first thread's
arena). Under load, every thread that runs model calls or copies tensors (model threads, the
event loop, the encoder's request drivers) grows its own pool: measured on the bench of #13, the
colocated server's peak PSS 1,469-1,566 MiB with glibc, 1,257-1,290 MiB with tcmalloc, at the same
requests/s (docs/benchmarks.md, "Memory allocator"). PyTorch's CPU performance guide and vLLM's
CPU backend recommend the same library, by LD_PRELOAD.

An allocator is chosen when a process starts (it must be the malloc every shared library binds
to), so `epd serve` started without it runs itself again at once (`epd.cli.preload`: same pid, same
command line) with the library first in LD_PRELOAD; the stack's services inherit the variable
from its launcher. Only the command line's own `main()` does this (`argv` None): a test or the
zygote calling `main(argv)` in its process is never replaced.

    auto      tcmalloc if found (Debian/Ubuntu: libtcmalloc-minimal4; conda: gperftools), else
              glibc's malloc, saying so once at INFO; a jemalloc or mimalloc the process was
              started with (LD_PRELOAD) is kept
    tcmalloc  tcmalloc, or exit 2 saying what to install
    system    the process's allocator as started (LD_PRELOAD left as it is)

No PyPI package ships tcmalloc: the container image installs it (compose/Dockerfile), CI too.
tcmalloc keeps freed memory for reuse; a serving process gives it back once idle
(`epd.transport.idle_memory`, which also calls glibc's `malloc_trim` when tcmalloc is not there).
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from collections.abc import Mapping

from epd.cli.preload_plan import PreloadPlan, mapped_libraries, preload_entries

ALLOCATORS = ("auto", "tcmalloc", "system")
# The minimal build first: the full one adds a heap profiler and checker that serving never uses.
_LIBRARY_NAMES = ("tcmalloc_minimal", "tcmalloc")
_INSTALL_HINT = "install libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools (conda)"
# Another malloc the operator preloaded on purpose: `auto` keeps it (`tcmalloc` still replaces it).
_OTHER_ALLOCATORS = ("libjemalloc", "libmimalloc")


def plan_allocator(choice: str, environ: Mapping[str, str], mapped: str, library: str | None) -> PreloadPlan:
    """What to do for `--allocator choice`, given the process's environment, the text of its
    memory map (/proc/self/maps: which libraries are loaded) and the tcmalloc library found (None:
    none). Pure, so every case is unit-tested without starting a process."""
    if choice == "system" or "libtcmalloc" in mapped:
        return PreloadPlan()
    if choice == "auto" and (other := next((lib for lib in _OTHER_ALLOCATORS if lib in mapped), None)):
        return PreloadPlan(note=f"memory allocator: {other}, as the process was started (LD_PRELOAD)")
    if library is None:
        if choice == "tcmalloc":
            return PreloadPlan(
                error=f"--allocator tcmalloc: no tcmalloc library found; {_INSTALL_HINT}, "
                "or pass --allocator system"
            )
        return PreloadPlan(
            note=f"memory allocator: glibc malloc (tcmalloc not found; {_INSTALL_HINT} for a "
            "lower peak memory under load, docs/architecture.md)"
        )
    preload = preload_entries(environ)
    if library in preload:
        # Started again with it and still not loaded (the dynamic loader said why on stderr): never
        # a second exec, which would loop.
        problem = f"{library} is in LD_PRELOAD but was not loaded"
        if choice == "tcmalloc":
            return PreloadPlan(
                error=f"--allocator tcmalloc: {problem}; check the library, or pass --allocator system"
            )
        return PreloadPlan(note=f"memory allocator: glibc malloc ({problem})")
    return PreloadPlan(exec_env={**environ, "LD_PRELOAD": ":".join([library, *preload])})


def find_tcmalloc() -> str | None:
    """The tcmalloc library to preload: one in this Python's prefix (a conda environment's
    gperftools) as a path, else one the dynamic loader finds by name (its soname, as ldconfig
    knows it); None if neither."""
    for name in _LIBRARY_NAMES:
        found = sorted(glob.glob(os.path.join(sys.prefix, "lib", f"lib{name}.so*")))
        if found:
            return found[0]
    for name in _LIBRARY_NAMES:
        if (soname := ctypes.util.find_library(name)) is not None:
            return soname
    return None


def uses_tcmalloc(pid: int | str = "self") -> bool:
    return "libtcmalloc" in mapped_libraries(pid)
