"""`--allocator` (`epd serve`, `epd ask` embedded): what the process does about its malloc before
anything else (epd/cli/allocator.py). The processes themselves (the colocated server and the stack's
services on tcmalloc where it is installed) are tested in tests/e2e/test_cli_serve.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epd.cli.allocator import find_tcmalloc, plan_allocator
from tests.stack import ROOT, child_env

LIB = "libtcmalloc_minimal.so.4"
GLIBC_ONLY_MAP = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
TCMALLOC_MAP = GLIBC_ONLY_MAP + f"7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/{LIB}.5.10\n"


def test_auto_runs_the_process_again_with_tcmalloc_first_in_ld_preload():
    env = {"PATH": "/usr/bin", "LD_PRELOAD": "libother.so"}
    plan = plan_allocator("auto", env, GLIBC_ONLY_MAP, LIB)
    assert plan.exec_env == {"PATH": "/usr/bin", "LD_PRELOAD": f"{LIB}:libother.so"}
    assert plan.error is None and plan.note is None
    assert env["LD_PRELOAD"] == "libother.so", "the caller's environment is not changed"


def test_explicit_tcmalloc_without_ld_preload_sets_only_it():
    plan = plan_allocator("tcmalloc", {"HOME": "/root"}, GLIBC_ONLY_MAP, LIB)
    assert plan.exec_env == {"HOME": "/root", "LD_PRELOAD": LIB}


@pytest.mark.parametrize("choice", ["auto", "tcmalloc"])
def test_a_process_already_on_tcmalloc_goes_on(choice):
    """The stack's services (started with the launcher's LD_PRELOAD), or a user's own preload."""
    assert plan_allocator(choice, {"LD_PRELOAD": LIB}, TCMALLOC_MAP, LIB) == plan_allocator(
        choice, {}, TCMALLOC_MAP, None
    )
    plan = plan_allocator(choice, {}, TCMALLOC_MAP, LIB)
    assert plan.exec_env is None and plan.error is None and plan.note is None


def test_auto_keeps_another_malloc_the_operator_preloaded_and_tcmalloc_replaces_it():
    jemalloc_map = GLIBC_ONLY_MAP + "7f04-7f05 r-xp 0 08:01 3 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    env = {"LD_PRELOAD": "libjemalloc.so.2"}
    auto = plan_allocator("auto", env, jemalloc_map, LIB)
    assert auto.exec_env is None and auto.error is None and "libjemalloc" in auto.note
    assert plan_allocator("tcmalloc", env, jemalloc_map, LIB).exec_env == {
        "LD_PRELOAD": f"{LIB}:libjemalloc.so.2"
    }


def test_system_leaves_the_process_as_started():
    plan = plan_allocator("system", {"LD_PRELOAD": "libother.so"}, GLIBC_ONLY_MAP, LIB)
    assert plan.exec_env is None and plan.error is None and plan.note is None


def test_auto_without_tcmalloc_goes_on_and_says_what_to_install():
    plan = plan_allocator("auto", {}, GLIBC_ONLY_MAP, None)
    assert plan.exec_env is None and plan.error is None
    assert "glibc" in plan.note and "libtcmalloc-minimal4" in plan.note


def test_explicit_tcmalloc_without_it_is_an_error_that_says_what_to_do():
    plan = plan_allocator("tcmalloc", {}, GLIBC_ONLY_MAP, None)
    assert plan.exec_env is None
    assert "libtcmalloc-minimal4" in plan.error and "--allocator system" in plan.error


@pytest.mark.parametrize("separator", [":", " "])
def test_a_preload_that_did_not_load_is_never_tried_twice(separator):
    """Run again with the library in LD_PRELOAD and still not mapped (the loader refused it):
    another exec would loop forever."""
    env = {"LD_PRELOAD": f"libother.so{separator}{LIB}"}
    auto = plan_allocator("auto", env, GLIBC_ONLY_MAP, LIB)
    assert auto.exec_env is None and auto.error is None and "not loaded" in auto.note
    explicit = plan_allocator("tcmalloc", env, GLIBC_ONLY_MAP, LIB)
    assert explicit.exec_env is None and "not loaded" in explicit.error


@pytest.mark.parametrize(
    ("words", "choices"),
    [
        (["serve"], ("auto", "vendor")),
        (["serve", "--colocate", "--allocator", "system"], ("system", "vendor")),
        (["serve", "prefill", "--allocator", "tcmalloc"], ("tcmalloc", "vendor")),
        (["serve", "encoder", "--mkl-dispatch", "features"], ("auto", "features")),
        (["serve", "gateway"], None),
        (["ask", "v.mp4", "q"], ("auto", "vendor")),
        (
            ["ask", "v.mp4", "q", "--allocator", "system", "--mkl-dispatch", "features"],
            ("system", "features"),
        ),
        (["ask", "v.mp4", "q", "--endpoint", "127.0.0.1:1"], None),
        (["health", "127.0.0.1:1"], None),
    ],
)
def test_which_commands_run_themselves_again_with_which_preloads(words, choices):
    """The processes that load the model (and the stack's launcher, whose services inherit its
    LD_PRELOAD), with the same defaults: `epd serve` and `epd ask` embedded. The gateway (no model)
    and `epd ask --endpoint` (the model runs in the gateway's services) never run themselves again."""
    from epd.cli.main import parse_command
    from epd.cli.preload import preload_choices

    assert preload_choices(parse_command(words)) == choices


def test_found_library_is_one_the_loader_can_open():
    """Where the machine has tcmalloc (CI installs it), the name found loads; elsewhere None."""
    library = find_tcmalloc()
    if library is None:
        pytest.skip("no tcmalloc on this machine (libtcmalloc-minimal4)")
    import ctypes

    ctypes.CDLL(library)  # OSError if the name cannot be loaded


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc are Linux's")
@pytest.mark.parametrize(
    "words", [["serve", "prefill", "--model", "unused"], ["ask", "--no-video", "q", "--model", "unused"]]
)
def test_explicit_tcmalloc_that_cannot_be_had_exits_2_before_loading_anything(words):
    """The command line's own path (`main()` with argv None): an empty library search (no prefix
    copy, no ldconfig match) makes --allocator tcmalloc a usage error, not a started server or an
    answer from a model loaded on glibc's malloc."""
    code = (
        "import sys, epd.cli.allocator as a; a.find_tcmalloc = lambda: None; "
        f"sys.argv = ['epd', *{words!r}, '--allocator', 'tcmalloc']; "
        "from epd.cli.main import main; code = main(); "
        "sys.exit(code if 'torch' not in sys.modules else 99)"
    )
    env = child_env()
    env.pop("LD_PRELOAD", None)  # a process started on tcmalloc has it already: nothing to refuse
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert f"epd {words[0]}: --allocator tcmalloc: no tcmalloc library found" in proc.stderr
    assert "--allocator system" in proc.stderr
