"""Which of MKL's kernels this process's float32 matrix products run on, logged when a model loads,
with a hint where MKL runs its generic kernels on a CPU that can do better (`--mkl-dispatch
features` of `epd serve` and `epd ask`, epd/cli/mkl_dispatch.py).

MKL's version record names its kernels (`Processor`, as `MKL_VERBOSE` prints it), but it asks
another vendor check (`mkl_serv_intel_cpu`) than the matrix products do (`mkl_serv_intel_cpu_true`,
the one `--mkl-dispatch features` answers): with the library preloaded the record still says
"generic" while sgemm runs its AVX-512 kernels (measured: their results and speed). So the note
asks the products' own check, as the dynamic loader resolves it for MKL."""

from __future__ import annotations

import ctypes
from pathlib import Path

GENERIC_KERNELS = "Intel(R) Architecture processors"
"""MKL's name for its generic kernels: what it runs on a CPU that is not Intel's."""


class _MklVersion(ctypes.Structure):
    # MKLVersion of mkl_types.h: three ints, then four strings.
    _fields_ = [
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("update", ctypes.c_int),
        ("product_status", ctypes.c_char_p),
        ("build", ctypes.c_char_p),
        ("processor", ctypes.c_char_p),
        ("platform", ctypes.c_char_p),
    ]


def mkl_kernels() -> str | None:
    """MKL's kernels in this process (e.g. "Intel(R) Advanced Vector Extensions 512 ..."), or None
    where torch has no MKL (an ARM build) or hides its symbols."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get_version = ctypes.CDLL(str(library)).mkl_serv_get_version
    except (OSError, AttributeError):
        return None
    record = _MklVersion()
    get_version(ctypes.byref(record))
    return record.processor.decode(errors="replace") if record.processor else None


def intel_check_answered_yes() -> bool:
    """Whether `mkl_serv_intel_cpu_true`, looked up as MKL's calls find it (the process's global
    scope, where a preloaded library comes first), says yes: --mkl-dispatch features' library.
    torch loads libtorch_cpu locally, so without a preload the lookup finds nothing."""
    try:
        check = ctypes.CDLL(None).mkl_serv_intel_cpu_true
    except AttributeError:
        return False
    check.restype = ctypes.c_int
    return bool(check())


def cpu_flags(cpuinfo: str) -> set[str]:
    """The instruction-set flags of /proc/cpuinfo's first processor."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def kernels_note(kernels: str | None, answered_yes: bool, flags: set[str]) -> str | None:
    """The start-up line about MKL's kernels (None without MKL), given the version record's name
    for them, whether the products' vendor check answers yes, and the CPU's flags: a hint to change
    them where MKL runs its generic kernels on a CPU with AVX2 or AVX-512."""
    if kernels is None:
        return None
    best = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    if kernels == GENERIC_KERNELS and answered_yes:
        return f"MKL kernels: by the CPU's instruction set ({best or 'SSE'}; --mkl-dispatch features)"
    if kernels == GENERIC_KERNELS and best is not None:
        return (
            f"MKL kernels: {kernels} (generic: MKL's choice on a CPU that is not Intel's); this CPU has "
            f"{best}: --mkl-dispatch features (epd serve, epd ask) runs MKL's {best} kernels "
            '(docs/benchmarks.md, "MKL\'s kernels on AMD CPUs")'
        )
    return f"MKL kernels: {kernels}"


def mkl_kernels_note() -> str | None:
    """`kernels_note` for this process and CPU."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        cpuinfo = ""
    return kernels_note(mkl_kernels(), intel_check_answered_yes(), cpu_flags(cpuinfo))
