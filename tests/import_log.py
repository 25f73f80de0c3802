"""What a fresh interpreter imports for a piece of code, and which import chain pulled a package in.

Checks of what a process must start without (the gateway without torch, the `epd` command line
without numpy) run the code in a new interpreter, so that what the test session already loaded
hides nothing; `-X importtime` logs every import, which names the culprit when one fails."""

from __future__ import annotations

import subprocess
import sys


def imported_packages(code: str) -> tuple[set[str], str]:
    """Top-level package names loaded once `code` has run in a fresh interpreter (the code must
    leave stdout to this: their names are printed last), and the import-time log."""
    code += "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(proc.stdout.split()), proc.stderr


def who_imported(log: str, name: str) -> str:
    """The chain of imports that first loaded `name`, from the import-time log (which lists a
    module after the modules it imported, indented one step deeper than its importer)."""
    rows = [line.split("|")[-1] for line in log.splitlines() if line.startswith("import time:")]
    at = next(i for i, row in enumerate(rows) if row.strip() == name)
    chain, depth = [name], len(rows[at]) - len(rows[at].lstrip())
    for row in rows[at + 1 :]:
        indent = len(row) - len(row.lstrip())
        if indent < depth:
            chain.append(row.strip())
            depth = indent
    return " <- ".join(chain)
