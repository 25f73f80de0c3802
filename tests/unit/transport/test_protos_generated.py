"""The checked-in generated code is exactly what protoc makes from the .proto files."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_matches_protos(tmp_path):
    shutil.copytree(
        ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__")
    )
    # -I protos: the wire package is `epd.v1` (installed as epd/v1, see pyproject's package-dir).
    protos = sorted(
        str(p.relative_to(tmp_path / "protos")) for p in (tmp_path / "protos/epd/v1").glob("*.proto")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            *protos,
        ],
        cwd=tmp_path / "protos",
        check=True,
    )
    generated = sorted((tmp_path / "protos/epd/v1").glob("*_pb2*"))
    assert len(generated) == 3 * len(protos)
    for g in generated:
        checked_in = ROOT / "protos/epd/v1" / g.name
        assert checked_in.read_text() == g.read_text(), f"{g.name} is stale: run scripts/gen_protos.sh"


def test_every_rpc_and_field_is_commented():
    for proto in (ROOT / "protos/epd/v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} rpc without a comment"
