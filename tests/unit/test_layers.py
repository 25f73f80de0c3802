"""The import direction that docs/architecture.md draws: nothing imports upward, no package circles,
and no gRPC below the transport layer.

    0 wire        epd.v1 (generated from protos/)
    1 libraries   epd.video, epd.token_pruning, epd.model_runtime, epd.resources, epd.cmdline
    2 domain      epd.stages (types, errors, contracts, server config; threads that run engine work)
    3 engines     epd.{encoder,prefill,decode}_svc, except their gRPC modules
    4 transport   epd.transport; the services' servicer.py, server.py and kv_pull.py
    5 front doors epd.gateway, epd.client, epd.cli, epd.bench, epd.synth, epd.train

In tests/, test modules are leaves: none imports another (its helpers would hide in a test file,
and a test's outcome would hang on which file pytest collected first); what two test files share
lives in a module not named test_* beside them, or in their folder's conftest.py.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

EPD = Path(__file__).resolve().parents[2] / "epd"
SERVICES = ("encoder_svc", "prefill_svc", "decode_svc")
GRPC_MODULES = ("servicer", "server", "kv_pull")
LAYER_NAMES = ["wire", "libraries", "domain", "engines", "transport", "front doors"]
PACKAGE_LAYER = {
    "v1": 0, "video": 1, "token_pruning": 1, "model_runtime": 1, "resources": 1, "cmdline": 1, "stages": 2,
    "transport": 4, "gateway": 5, "client": 5, "cli": 5, "bench": 5, "synth": 5, "train": 5,
}  # fmt: skip


def layer_of(module: str) -> int:
    parts = module.split(".")
    assert parts[0] == "epd", module
    if len(parts) == 1:
        return 0  # epd/__init__.py: a docstring
    package = parts[1]
    if package in SERVICES:
        return 4 if len(parts) > 2 and parts[2] in GRPC_MODULES else 3
    assert package in PACKAGE_LAYER, f"{module}: a new package needs a layer in this test and the docs"
    return PACKAGE_LAYER[package]


def epd_modules() -> dict[str, Path]:
    """Module name -> file, through the symlinks that put the top-level folders under epd/."""
    modules = {}
    files = [
        Path(d) / f for d, _, names in os.walk(EPD, followlinks=True) for f in names if f.endswith(".py")
    ]
    for path in sorted(files):
        rel = path.relative_to(EPD.parent).with_suffix("")
        if "_pb2" in rel.name or any(p in ("models", "samples") for p in rel.parts):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules[".".join(parts)] = path
    return modules


def absolute_module(node: ast.ImportFrom, package: str) -> str:
    """The module `from ... import` names, a relative one resolved against `package`."""
    base = node.module or ""
    if node.level:
        base = ".".join(
            package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
        )
    return base


def imports_of(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported epd module or 'grpc', line) for every import in the file, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((absolute_module(node, package), node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] in ("epd", "grpc", "grpc_health")]


MODULES = epd_modules()


def test_the_walk_sees_every_layer():
    seen = {layer_of(m) for m in MODULES}
    assert seen == set(range(6)), seen
    assert {"epd.video.types", "epd.encoder_svc.engine", "epd.transport.errors", "epd.v1"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_imports_upward_and_no_grpc_below_transport(module):
    mine = layer_of(module)
    bad = []
    for name, line in imports_of(MODULES[module], module):
        if name.startswith("grpc"):
            if mine < 4:
                bad.append(f"line {line}: gRPC in the {LAYER_NAMES[mine]} layer")
            continue
        if name == "epd":
            continue
        theirs = layer_of(name)
        if theirs > mine:
            bad.append(f"line {line}: {name} ({LAYER_NAMES[theirs]}) above {LAYER_NAMES[mine]}")
        if module.startswith("epd.transport.") and name.split(".")[1] in SERVICES:
            bad.append(f"line {line}: transport is a library for the services; it must not import {name}")
    assert bad == [], f"{module}: " + "; ".join(bad)


def test_no_package_circles():
    """Package graph (epd.X -> epd.Y) without cycles: the `package_cycles` check one level down."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        mine = module.split(".")[1] if "." in module else ""
        for name, _ in imports_of(path, module):
            parts = name.split(".")
            if parts[0] == "epd" and len(parts) > 1 and mine and parts[1] != mine:
                edges.setdefault(mine, set()).add(parts[1])

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in edges for b in edges[a] if reaches(b, a, set()))
    assert circles == [], circles


ROOT = EPD.parent


def imported_test_modules(source: str, package: str) -> list[str]:
    """'line N: tests.x.test_y' for each test module of tests/ that `source` (a module of `package`)
    imports, in any form: `import`, `from ... import name`, `from package import test_module`,
    relative, or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute_module(node, package)
            submodules = [f"{base}.{a.name}" for a in node.names]
            names = [base] + [m for m in submodules if (ROOT / (m.replace(".", "/") + ".py")).is_file()]
        else:
            continue
        found += [
            f"line {node.lineno}: {name}"
            for name in names
            if name.split(".")[0] == "tests" and name.rpartition(".")[2].startswith("test_")
        ]
    return found


def test_the_check_finds_a_test_module_imported_in_every_form():
    source = (
        "import aiohttp.test_utils\n"
        "from tests.stack import Stack\n"
        "from tests.integration.test_completions import PROMPT\n"
        "import tests.unit.test_layers\n"
        "from tests.unit import test_layers, conftest\n"
        "from . import test_layers as layers\n"
        "from .test_layers import EPD\n"
        "def f():\n"
        "    from ..integration.test_completions import PROMPT\n"
    )
    assert imported_test_modules(source, "tests.unit") == [
        "line 3: tests.integration.test_completions",
        "line 4: tests.unit.test_layers",
        "line 5: tests.unit.test_layers",
        "line 6: tests.unit.test_layers",
        "line 7: tests.unit.test_layers",
        "line 9: tests.integration.test_completions",
    ]


def test_no_module_of_tests_imports_a_test_module():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        rel = path.relative_to(ROOT)
        bad += [
            f"{rel} {found}" for found in imported_test_modules(path.read_text(encoding="utf-8"), package)
        ]
    assert bad == [], (
        "a test module imports another; move what they share into a module not named test_* beside "
        "them (or the folder's conftest.py for a fixture): " + "; ".join(bad)
    )
