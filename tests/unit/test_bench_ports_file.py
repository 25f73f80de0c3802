"""The bench scripts that also run an older revision (bench/bench_startup.py,
bench/bench_prefill_tokenizer.py, each from `git archive REV`) give `epd serve` --ports-file when
that revision's `epd serve --help` shows it, and ports picked with `free_port` otherwise: an older
`epd serve` exits 2 on a flag it does not know."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from bench.common import takes_ports_file
from tests.stack import ROOT


def _before_ports_file() -> str:
    """The commit before the one that gave `epd serve` --ports-file."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    path = "epd/cli/flags/server.py"
    command = ["git", "log", "--format=%H", "--reverse", "-S", "add_ports_file_flag", "--", path]
    found = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        pytest.skip("needs the repository's git history")
    return found.stdout.split()[0] + "^"


@pytest.mark.parametrize("role", ["", "prefill"])
def test_ports_file_is_given_only_to_a_revision_that_takes_it(role, tmp_path):
    assert takes_ports_file(ROOT, role)
    archive = subprocess.run(
        ["git", "archive", _before_ports_file()], cwd=ROOT, capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    assert not takes_ports_file(tmp_path, role)
