"""The wheel as a user installs it: built from the repository's files, installed into a fresh venv,
run from outside the checkout. It must claim only the `epd` import name and carry everything
`epd ask` and `epd bench quality` need (the demo model, the samples, the synthetic-data generator).

The fresh venv borrows the dependencies (torch, transformers, ...) of the test venv through a .pth
line, which adds that site-packages as a plain path: its own .pth files (the editable install of the
checkout) are not run, so `import epd` can only find the installed wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    env["EPD_CACHE_DIR"] = str(cwd / "cache")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    # The files git would ship (tracked, plus new ones not ignored), symlinks kept as symlinks.
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    src = tmp / "src"
    for name in filter(None, listed):
        rel = Path(os.fsdecode(name))
        if not (ROOT / rel).exists() and not (ROOT / rel).is_symlink():
            continue  # deleted in the working tree
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / rel).is_symlink():
            (src / rel).symlink_to(os.readlink(ROOT / rel))
        else:
            shutil.copy2(ROOT / rel, src / rel)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("epd-*.whl")

    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "epd_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], cwd=tmp)
    work = tmp / "elsewhere"  # not the checkout, and not its parent
    work.mkdir()
    return {"python": python, "epd": bin_dir / "epd", "site": site, "work": work}


def test_the_wheel_claims_only_epd(installed):
    site = installed["site"]
    tops = sorted(p.name for p in site.iterdir() if p.name != "epd_test_deps.pth" and p.name != "__pycache__")
    assert [t for t in tops if not t.endswith(".dist-info")] == ["epd"]
    (dist_info,) = [t for t in tops if t.endswith(".dist-info")]
    record = (site / dist_info / "RECORD").read_text()
    outside = [
        line for line in record.splitlines() if not line.startswith(("epd/", "epd-", "../../../bin/epd,"))
    ]
    assert outside == [], outside  # the console script `epd` is the only thing outside epd/
    # What the layout maps under epd/: wire code, the spec'd folders, the shipped model and samples.
    for part in (
        "epd/v1/encoder_pb2.py",
        "epd/v1/encoder.proto",
        "epd/video/media_open.py",
        "epd/encoder_svc/engine.py",
        "epd/train/train_default_model.py",
        "epd/gateway/web/static/app.js",
        "epd/models/epd-tiny-videoqa/model.safetensors",
        "epd/samples/sample.mp4",
    ):
        assert part in record, part
    where = _run(
        [str(installed["python"]), "-c", "import epd.cli.main, epd; print(epd.__file__)"],
        cwd=installed["work"],
    ).stdout.strip()
    assert Path(where).is_relative_to(site), where


def test_epd_ask_on_the_sample_from_outside_the_checkout(installed):
    sample = installed["site"] / "epd/samples/sample.mp4"
    card = json.loads((installed["site"] / "epd/samples/sample.json").read_text())
    first = card["video"]["questions"][0]
    out = _run(
        [str(installed["epd"]), "ask", str(sample), first["question"], "--json"], cwd=installed["work"]
    )
    answer = json.loads(out.stdout)
    assert answer["answer"].strip() == first["answer"], answer
    # The notice cites the shipped model's card: the one inside the installed package.
    assert str(installed["site"] / "epd/models/epd-tiny-videoqa") in answer["notice"], answer["notice"]


def test_epd_bench_quality_from_outside_the_checkout(installed):
    out_dir = installed["work"] / "quality"
    _run(
        [
            str(installed["epd"]),
            "bench",
            "quality",
            "--max-questions",
            "20",
            "--presets",
            "off",
            "--no-progress",
            "--out",
            str(out_dir),
        ],
        cwd=installed["work"],
        timeout=600,
    )
    report = json.loads((out_dir / "quality.json").read_text())
    (overall,) = [r for r in report["rows"] if r["preset"] == "off" and r["question_type"] == "overall"]
    assert overall["num_questions"] == 20
    assert report["num_test_clips"] == 20  # rendered only the clips of its first 20 questions, not 500
    assert overall["accuracy"] >= 0.75, overall  # the shipped demo model, not a random one
