"""`--mkl-dispatch` (`epd serve`, `epd ask` embedded): the plan (epd/cli/mkl_dispatch.py), its
library built for real with the machine's C compiler, the two preloads planned into one exec
(epd/cli/preload.py), and the start-up note on MKL's kernels (epd/model_runtime/mkl_kernels.py).
The served process and `epd ask`'s own are tested in tests/e2e/test_cli_serve.py and test_cli_ask.py."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from epd.cli.mkl_dispatch import build_shim, find_compiler, plan_mkl_dispatch, shim_path
from epd.cli.preload import plan_preloads
from epd.cli.preload_plan import PreloadPlan
from epd.model_runtime.mkl_kernels import GENERIC_KERNELS, cpu_flags, kernels_note
from tests.stack import ROOT, child_env

LIB = Path("/cache/epd/libepd_mkl_features-0123456789ab.so")
PLAIN_MAP = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
SHIM_MAP = PLAIN_MAP + f"7f02-7f03 r-xp 0 08:01 2 {LIB}\n"
AVX512 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n"

needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C compiler (cc, gcc or $CC)")


def test_vendor_leaves_the_process_as_started():
    assert (
        plan_mkl_dispatch("vendor", {"LD_PRELOAD": "libx.so"}, PLAIN_MAP, "x86_64", None, None)
        == PreloadPlan()
    )


def test_features_runs_the_process_again_with_the_library_after_the_others():
    env = {"PATH": "/usr/bin", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    plan = plan_mkl_dispatch("features", env, PLAIN_MAP, "x86_64", LIB, None)
    assert plan.exec_env == {"PATH": "/usr/bin", "LD_PRELOAD": f"libtcmalloc_minimal.so.4:{LIB}"}
    assert plan.error is None and plan.note is None
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4", "the caller's environment is not changed"


def test_a_process_with_the_library_loaded_goes_on():
    """The process run again, and the stack's services (started with the launcher's LD_PRELOAD)."""
    plan = plan_mkl_dispatch("features", {"LD_PRELOAD": str(LIB)}, SHIM_MAP, "x86_64", LIB, None)
    assert plan == PreloadPlan()


def test_a_library_in_ld_preload_that_did_not_load_is_an_error_not_a_second_exec():
    plan = plan_mkl_dispatch("features", {"LD_PRELOAD": str(LIB)}, PLAIN_MAP, "x86_64", LIB, None)
    assert plan.exec_env is None and "in LD_PRELOAD but was not loaded" in plan.error


def test_features_without_a_library_says_why():
    plan = plan_mkl_dispatch("features", {}, PLAIN_MAP, "x86_64", None, "no C compiler; install gcc")
    assert plan.exec_env is None and plan.error == "no C compiler; install gcc"


def test_features_on_another_architecture_is_refused():
    plan = plan_mkl_dispatch("features", {}, PLAIN_MAP, "aarch64", LIB, None)
    assert plan.exec_env is None and "x86-64" in plan.error and "aarch64" in plan.error


def test_the_two_preloads_run_again_once_with_both():
    """The allocator's plan first; MKL's planned on its environment: one exec with both."""
    allocator = PreloadPlan(exec_env={"LD_PRELOAD": "libtcmalloc_minimal.so.4"})
    mkl = plan_mkl_dispatch("features", allocator.exec_env, PLAIN_MAP, "x86_64", LIB, None)
    assert plan_preloads(allocator, mkl) == (
        {"LD_PRELOAD": f"libtcmalloc_minimal.so.4:{LIB}"},
        None,
    )
    assert plan_preloads(allocator, PreloadPlan()) == (allocator.exec_env, None)
    assert plan_preloads(PreloadPlan(), PreloadPlan()) == (None, None)


def test_an_error_of_either_preload_stops_before_any_exec():
    allocator = PreloadPlan(error="--allocator tcmalloc: no tcmalloc library found")
    mkl = PreloadPlan(exec_env={"LD_PRELOAD": str(LIB)})
    assert plan_preloads(allocator, mkl) == (None, allocator.error)
    assert plan_preloads(PreloadPlan(exec_env={}), PreloadPlan(error="no compiler")) == (
        None,
        "no compiler",
    )


@needs_compiler
def test_the_library_is_built_once_and_exports_mkls_check(tmp_path):
    built, error = build_shim(tmp_path, find_compiler())
    assert error is None and built == shim_path(tmp_path) and built.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [built.name], "no partial file left"
    check = ctypes.CDLL(str(built)).mkl_serv_intel_cpu_true
    assert check() == 1
    # Found built: no compiler needed the second time.
    assert build_shim(tmp_path, None) == (built, None)


def test_without_a_compiler_nothing_is_built_and_the_error_says_what_to_install(tmp_path):
    built, error = build_shim(tmp_path, None)
    assert built is None and "no C compiler" in error and "gcc" in error
    assert list(tmp_path.iterdir()) == []


def test_a_compiler_that_fails_leaves_nothing_and_says_so(tmp_path):
    built, error = build_shim(tmp_path, "/bin/false")
    assert built is None and "/bin/false could not build" in error
    assert list(tmp_path.iterdir()) == []


@needs_compiler
def test_mkls_own_lookup_finds_the_preloaded_check_in_a_real_process(tmp_path):
    """What MKL's calls inside libtorch_cpu resolve to: the preloaded library's answer, yes; without
    it, nothing in the global scope (torch loads libtorch_cpu locally)."""
    built, _ = build_shim(tmp_path, find_compiler())
    code = "from epd.model_runtime.mkl_kernels import intel_check_answered_yes as y; print(y())"
    answers = [
        subprocess.run(
            [sys.executable, "-c", code], env={**child_env(), "LD_PRELOAD": preload},
            capture_output=True, text=True, cwd=ROOT, check=True,
        ).stdout.strip()
        for preload in (str(built), "")
    ]  # fmt: skip
    assert answers == ["True", "False"]


def test_the_note_hints_at_the_flag_where_mkl_runs_generic_kernels_on_a_capable_cpu():
    flags = cpu_flags(AVX512)
    assert {"avx2", "avx512f"} <= flags
    hint = kernels_note(GENERIC_KERNELS, False, flags)
    assert "--mkl-dispatch features" in hint and "AVX-512" in hint
    assert "AVX2" in kernels_note(GENERIC_KERNELS, False, {"avx2"})
    assert kernels_note(GENERIC_KERNELS, False, {"sse2"}) == f"MKL kernels: {GENERIC_KERNELS}"
    assert kernels_note(GENERIC_KERNELS, True, flags) == (
        "MKL kernels: by the CPU's instruction set (AVX-512; --mkl-dispatch features)"
    )
    intel = "Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512)"
    assert kernels_note(intel, False, flags) == f"MKL kernels: {intel}"
    assert kernels_note(None, False, flags) is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL's dispatch is x86-64's")
def test_a_library_built_beforehand_is_used_instead_of_building_one(tmp_path, monkeypatch):
    """$EPD_MKL_FEATURES_LIBRARY (the container image's, built in a stage with a compiler)."""
    from epd.cli.mkl_dispatch import LIBRARY_ENV, mkl_library

    prebuilt = tmp_path / "libepd_mkl_features.so"
    prebuilt.write_bytes(b"\x7fELF")
    monkeypatch.setenv(LIBRARY_ENV, str(prebuilt))
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path / "cache"))
    assert mkl_library("features") == (prebuilt, None)
    assert not (tmp_path / "cache").exists(), "nothing built"
    assert mkl_library("vendor") == (None, None)
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "missing.so"))
    library, error = mkl_library("features")
    assert library is None and "missing.so is not a file" in error and "unset it" in error


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL's dispatch is x86-64's")
def test_a_relative_library_path_is_made_absolute(tmp_path, monkeypatch):
    """LD_PRELOAD's entry must match the memory map's path, which the loader writes absolute."""
    from epd.cli.mkl_dispatch import LIBRARY_ENV, mkl_library

    (tmp_path / "libepd_mkl_features.so").write_bytes(b"\x7fELF")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(LIBRARY_ENV, "libepd_mkl_features.so")
    assert mkl_library("features") == (tmp_path / "libepd_mkl_features.so", None)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="MKL's dispatch is x86-64's")
@pytest.mark.parametrize(
    "words", [["serve", "prefill", "--model", "unused"], ["ask", "--no-video", "q", "--model", "unused"]]
)
def test_features_without_its_library_exits_2_before_loading_anything(tmp_path, words):
    """The command line's own path (`main()` with argv None), `epd serve` and `epd ask` embedded
    alike: a library that cannot be had is a usage error before torch loads, not a model run on
    MKL's generic kernels."""
    from epd.cli.mkl_dispatch import LIBRARY_ENV

    code = (
        f"import sys; sys.argv = ['epd', *{words!r}, '--mkl-dispatch', 'features']; "
        "from epd.cli.main import main; code = main(); "
        "sys.exit(code if 'torch' not in sys.modules else 99)"
    )
    env = {**child_env(), LIBRARY_ENV: str(tmp_path / "missing.so")}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert f"epd {words[0]}: --mkl-dispatch features: {LIBRARY_ENV}=" in proc.stderr
    assert "missing.so is not a file" in proc.stderr
