"""The wheel's package list (pyproject's explicit `packages`, mapped by `package-dir`) names every
package of the tree: a new sub-package left out installs without its modules, and `epd` then fails
at import outside a checkout (tests/e2e/test_wheel.py finds that too, but slowly; this finds it here)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[3]


def _tree_packages(setuptools: dict) -> set[str]:
    """Every dotted package name the package-dir mapping gives to a folder holding __init__.py (the
    symlinks in epd/ to the top-level folders are not followed: those are their own mappings)."""
    found = set()
    for name, folder in setuptools["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if any(part.startswith((".", "_")) or part == "node_modules" for part in rel.parts):
                continue
            dotted = ".".join((name, *rel.parts))
            found.add(dotted)
    return found


def test_every_package_in_the_tree_is_in_the_wheel():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = sorted(_tree_packages(setuptools) - set(setuptools["packages"]))
    assert missing == [], f"add these to pyproject.toml's [tool.setuptools] packages: {missing}"
