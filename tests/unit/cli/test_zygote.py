"""What the stack's zygote imports before it forks the model services (epd/cli/zygote.py).

A preload that does not import is skipped silently by the fork server, and the services would then
each import it again, unshared: so every name must import, and each family's modelling file must be
among them. The forked process tree itself is tested in tests/integration/test_lifecycle.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from epd.cli.zygote import (
    ServiceProcess,
    _no_main_for_the_child,
    clean_file_mappings,
    preload_modules,
    smaps_mappings,
)
from epd.model_runtime.loader import _FAMILIES, family_module
from tests.stack import ROOT, child_env


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_every_preloaded_module_imports(model_type):
    modules = preload_modules(model_type, family_module(model_type))
    assert f"transformers.models.{model_type}.modeling_{model_type}" in modules
    assert f"epd.model_runtime.{_FAMILIES[model_type][0]}" in modules
    # First the zygote's signal dispositions (not imported here: it makes its importer ignore
    # SIGTERM; tests/integration/test_lifecycle.py checks it in a stack), then torch.
    assert modules[:2] == ["epd.cli.zygote_signals", "torch"]
    for name in modules[1:]:
        importlib.import_module(name)


def test_a_hub_id_preloads_the_common_part_only():
    modules = preload_modules(None, None)
    assert "torch" in modules and "transformers" in modules
    assert not [m for m in modules if m.startswith(("transformers.models.qwen", "epd.model_runtime.qwen"))]


def test_listing_the_preload_imports_no_torch():
    """The launcher computes the list: it must not import what it lists."""
    code = (
        "import sys; from epd.cli.zygote import ServiceProcess, preload_modules; preload_modules('qwen2_vl', 'qwen2_vl'); "
        "sys.exit(sorted(m for m in ('torch', 'transformers') if m in sys.modules) != [])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_a_service_reaped_between_the_check_and_the_signal_is_not_an_error():
    """The launcher's stop read `exitcode` (None: running), then another thread reaped the service
    before `os.kill`: ProcessLookupError crashed the stop (exit 1). A stand-in process whose check
    still says running while its pid is already reaped takes that interleaving."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names nothing now

    class ReapedAfterTheCheck:
        exitcode = None
        pid = child.pid

    ServiceProcess(ReapedAfterTheCheck()).send_signal(15)  # type: ignore[arg-type]


def test_the_preload_imports_no_grpc():
    """gRPC is not fork-safe once initialised: nothing the zygote imports before it forks may bring
    it in (the gRPC-free part of the command line and the stages' configs is preloaded; what
    imports grpc is imported by each service after the fork)."""
    modules = [
        m for m in preload_modules("qwen2_vl", family_module("qwen2_vl")) if m != "epd.cli.zygote_signals"
    ]
    code = f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
    code += "sys.exit(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')) != [])"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_starts_from_two_threads_put_the_real_main_back():
    """`Zygote.start` swaps `sys.modules["__main__"]` for a bare module while it starts a child.
    Two threads swapping at once, the second inside the first's swap and done after it, put back
    the first's bare module for good: they take turns instead."""
    real = sys.modules["__main__"]
    inside, first_done = threading.Event(), threading.Event()

    def second() -> None:
        with _no_main_for_the_child():
            inside.set()
            first_done.wait(30)

    thread = threading.Thread(target=second)
    try:
        with _no_main_for_the_child():
            thread.start()
            inside.wait(0.5)  # the second's swap, inside this one's if nothing makes it wait
        first_done.set()
        thread.join(30)
        assert not thread.is_alive() and inside.is_set()
        assert sys.modules["__main__"] is real
    finally:
        first_done.set()
        sys.modules["__main__"] = real


def test_the_zygote_keeps_no_file_page_of_its_imports():
    """Importing torch faults in ~300 MiB of shared-library pages that the forked services never
    inherit (no page-table entries are copied for a clean file mapping) and mostly never touch:
    mapped by the zygote alone, they were all in the stack's PSS. The zygote drops them after its
    imports (epd/cli/zygote_trim.py); what it touches afterwards (its fork loop) is a few MiB."""
    code = (
        "import os, sys\n"
        "from epd.cli.zygote import Zygote, _fork_server\n"
        "z = Zygote(['torch'])\n"
        "z.start('probe', ['--help'], dict(os.environ), os.devnull).wait(120)\n"  # the zygote imported torch
        "print(_fork_server()._forkserver_pid)\n"
        "sys.stdin.readline()\n"  # the zygote lives until this process ends
    )
    env = child_env()
    env.pop("OMP_NUM_THREADS")  # as `epd serve --num-threads auto`: numpy's OpenBLAS starts a thread
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        smaps = Path(f"/proc/{int(proc.stdout.readline())}/smaps").read_text()
    finally:
        proc.kill()
        proc.wait(30)
    assert "libtorch_cpu.so" in smaps  # torch is imported, its libraries mapped
    file_rss = 1024 * sum(
        fields.get("Rss", 0) - fields.get("Anonymous", 0)
        for *_, path, fields in smaps_mappings(smaps)
        if path.startswith("/")
    )
    assert file_rss < 32 << 20, f"the zygote keeps {file_rss >> 20} MiB of file pages"


def test_only_clean_private_file_mappings_are_dropped():
    """A mapping with a private (copy-on-write) page would get the file's bytes back over it; a
    writable one could get one from another thread (numpy's OpenBLAS starts one at import)."""
    smaps = "\n".join(
        [
            "7f0000000000-7f0000002000 r-xp 00000000 08:01 11 /usr/lib/libclean.so",
            "Rss:                   8 kB",
            "Anonymous:             0 kB",
            "7f0000002000-7f0000003000 r--p 00002000 08:01 11 /usr/lib/libclean.so",
            "Rss:                   4 kB",
            "Anonymous:             4 kB",
            "7f0000003000-7f0000004000 r--p 00000000 08:01 12 /usr/lib/libcold.so",
            "Rss:                   0 kB",
            "Anonymous:             0 kB",
            "7f0000004000-7f0000005000 rw-s 00000000 00:05 13 /dev/shm/board",
            "Rss:                   4 kB",
            "Anonymous:             0 kB",
            "7f0000005000-7f0000006000 rw-p 00000000 00:00 0 ",
            "Rss:                   4 kB",
            "Anonymous:             4 kB",
            "7f0000006000-7f0000007000 rw-p 00000000 08:01 15 /usr/lib/libdata.so",
            "Rss:                   4 kB",
            "Anonymous:             0 kB",
            "7f0000007000-7f0000009000 r--p 00000000 08:01 14 /usr/lib/liblast.so",
            "Rss:                   8 kB",
            "Anonymous:             0 kB",
        ]
    )
    assert clean_file_mappings(smaps) == [(0x7F0000000000, 0x2000), (0x7F0000007000, 0x2000)]
