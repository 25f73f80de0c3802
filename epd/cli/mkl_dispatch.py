"""Which of MKL's kernels run the model's float32 matrix products (`--mkl-dispatch` of `epd serve`
and of `epd ask` embedded).

torch's matrix products on an x86 CPU are MKL's (sgemm). MKL chooses its kernels by the CPU's
vendor before its instruction set: on a CPU that is not Intel's it runs its generic kernels
("Intel(R) Architecture processors" in its version record), whatever the CPU can do. On the bench
VM (AMD EPYC with AVX-512) the model's linear layers took 2.3x as long as the same MKL's AVX-512
kernels at 307 rows (a prefill) and 3x at 2-12 rows (decode steps), and the stack served 1.3-1.6x
the requests/s at 16 in flight with them (docs/benchmarks.md, "MKL's kernels on AMD CPUs").

    vendor    MKL's own choice (the default)
    features  MKL's kernels for the CPU's instruction set, as on an Intel CPU: a one-function
              library, preloaded (LD_PRELOAD), answers MKL's is-this-Intel check
              (`mkl_serv_intel_cpu_true`, which torch's libtorch_cpu exports and MKL calls through
              it) with yes. It is built once from its C source (mkl_features_shim.c, next to this
              file) with the machine's C compiler (`$CC`, else cc or gcc) into epd's cache
              directory ($EPD_CACHE_DIR, default ~/.cache/epd); without a compiler the command
              exits 2 saying what to install. $EPD_MKL_FEATURES_LIBRARY names one built
              beforehand instead (the container image builds it in a stage of its own).

Off by default: those kernels sum in another order than the generic ones, so float32 results
differ in the last bits and a greedy token can differ from `generate()`'s in a process without the
library where its two best logits are that close (a near tie), as with `--linear-kernel onednn`;
with the library in both processes the tokens are the same (tests/integration/test_exactness.py
passes so, as on an Intel CPU).
On an Intel CPU the library changes nothing (MKL already chose by instruction set). Like the
allocator it must be in place before torch loads, so `epd serve` (or `epd ask` embedded) runs
itself again with it (`epd.cli.preload`), and the stack's services inherit the variable from their
launcher.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from epd.cli.preload_plan import PreloadPlan, preload_entries

MKL_DISPATCHES = ("vendor", "features")
SHIM_SOURCE = Path(__file__).with_name("mkl_features_shim.c")
_SHIM_STEM = "libepd_mkl_features"
LIBRARY_ENV = "EPD_MKL_FEATURES_LIBRARY"
"""A library built beforehand, used instead of building one."""
_COMPILER_HINT = "install a C compiler (Debian/Ubuntu: gcc) or set CC"


def shim_path(cache_dir: Path) -> Path:
    """The library's path for this source: named by the source's hash, so an edited source is
    built again instead of a stale library being preloaded."""
    digest = hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir / f"{_SHIM_STEM}-{digest}.so"


def build_shim(cache_dir: Path, compiler: str | None) -> tuple[Path | None, str | None]:
    """(the library, None) once built or found built; (None, the error line) otherwise."""
    target = shim_path(cache_dir)
    if target.is_file():
        return target, None
    if compiler is None:
        return (
            None,
            f"--mkl-dispatch features builds a one-function library and found no C compiler; {_COMPILER_HINT}",
        )
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        # A name of this process's own, then a rename: two processes building at once never
        # preload a half-written library.
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SHIM_SOURCE)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            return (
                None,
                f"--mkl-dispatch features: {compiler} could not build {SHIM_SOURCE.name} ({first}); {_COMPILER_HINT}",
            )
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (
            None,
            f"--mkl-dispatch features: could not build its library in {cache_dir} ({exc}); {_COMPILER_HINT}",
        )
    return target, None


def find_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    """The C compiler to build the library with: $CC, else cc or gcc on PATH (None: none)."""
    if cc := environ.get("CC"):
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def plan_mkl_dispatch(
    choice: str, environ: dict[str, str], mapped: str, machine: str, library: Path | None, error: str | None
) -> PreloadPlan:
    """What to do for `--mkl-dispatch choice`, given the environment (maybe already with the
    allocator's preload), the process's memory map, the CPU architecture (`platform.machine()`)
    and the library for it (or why there is none). Pure, so every case is unit-tested."""
    if choice == "vendor":
        return PreloadPlan()
    if machine not in ("x86_64", "AMD64"):
        return PreloadPlan(error=f"--mkl-dispatch features is for x86-64 CPUs (MKL); this one is {machine}")
    if library is None:
        return PreloadPlan(error=error or "--mkl-dispatch features: no library")
    if os.path.realpath(library) in mapped:  # the process run again, or a service of the stack
        return PreloadPlan()
    preload = preload_entries(environ)
    if str(library) in preload:
        # Started again with it and still not loaded: never a second exec, which would loop.
        return PreloadPlan(error=f"--mkl-dispatch features: {library} is in LD_PRELOAD but was not loaded")
    return PreloadPlan(exec_env={**environ, "LD_PRELOAD": ":".join([*preload, str(library)])})


def mkl_library(choice: str) -> tuple[Path | None, str | None]:
    """The library `plan_mkl_dispatch` needs for `features`: $EPD_MKL_FEATURES_LIBRARY, else the one
    built from the source (built now if it is not yet)."""
    if choice == "vendor" or platform.machine() not in ("x86_64", "AMD64"):
        return None, None
    if given := os.environ.get(LIBRARY_ENV):
        if not Path(given).is_file():
            return (
                None,
                f"--mkl-dispatch features: {LIBRARY_ENV}={given} is not a file; unset it to build the library",
            )
        return Path(given).absolute(), None  # LD_PRELOAD's entry and the memory map's path alike
    from epd.model_runtime.default_model import cache_dir

    return build_shim(cache_dir().absolute(), find_compiler())
