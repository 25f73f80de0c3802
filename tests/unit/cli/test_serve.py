"""`epd serve`'s launcher before it starts anything: the model check, the children's command
lines, and no torch (the real processes are in tests/integration/test_lifecycle.py)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from epd.cli import configs
from epd.cli.main import build_parser
from epd.cli.serve import stack_commands
from epd.model_runtime.loader import ModelLoadError, check_model_dir
from epd.resources import demo_model_dir
from epd.transport.errors import status_of
from tests.stack import ROOT, child_env


def _safetensors(path: Path, data_bytes: int, written_bytes: int | None = None) -> None:
    """A safetensors file of one float32 tensor: 8-byte header length, JSON header, data."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}}).encode()
    body = bytes(data_bytes if written_bytes is None else written_bytes)
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


def _checkpoint(root: Path, model_type: str = "qwen2_vl") -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    return root


def test_the_shipped_model_passes_the_check():
    assert check_model_dir(str(demo_model_dir())) in ("qwen2_vl", "qwen2_5_vl")


def test_sharded_weights_are_checked_shard_by_shard(tmp_path):
    root = _checkpoint(tmp_path / "m")
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _safetensors(root / "model-1.safetensors", 64)
    with pytest.raises(ModelLoadError, match="model-2.safetensors named in model.safetensors.index.json is missing"):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64, written_bytes=60)
    with pytest.raises(ModelLoadError, match="model-2.safetensors is truncated or corrupt"):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64)
    assert check_model_dir(str(root)) == "qwen2_vl"


@pytest.mark.parametrize("content, reason", [
    (b"", "truncated or corrupt"),  # empty
    (struct.pack("<Q", 1 << 40) + b"{}", "truncated or corrupt"),  # header longer than the file
    (struct.pack("<Q", 5) + b"nope!", "truncated or corrupt"),  # header not JSON
])
def test_unreadable_safetensors_headers_are_refused(tmp_path, content, reason):
    root = _checkpoint(tmp_path / "m")
    (root / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadError, match=reason):
        check_model_dir(str(root))


def test_config_problems_name_the_file(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        check_model_dir(str(root))
    (root / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is not readable JSON"):
        check_model_dir(str(root))
    with pytest.raises(ModelLoadError, match="no such directory"):
        check_model_dir(str(tmp_path / "absent" / "dir"))
    assert check_model_dir("Qwen/Qwen2-VL-2B-Instruct") is None  # a hub id: only loading can check it


def test_a_model_that_cannot_load_is_a_failed_precondition_with_its_reason():
    """What a service or `epd ask` (embedded) answers instead of INTERNAL."""
    code, message = status_of(ModelLoadError("/m", "model_type 'llama' is not supported; epd serves X"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert message == "cannot load /m: model_type 'llama' is not supported; epd serves X"


def test_grace_period_reaches_every_service():
    args = build_parser().parse_args(["serve", "--grace-period", "7.5"])
    args.model = "/m"
    for name, command in stack_commands(args).items():
        assert command[command.index("--grace-period") + 1] == "7.5", name
        role = build_parser().parse_args(command[command.index("serve"):])
        assert configs.server_config(role).grace_s == 7.5
    assert build_parser().parse_args(["serve", "decode"]).grace_period == 30.0


def test_the_prefix_cache_flags_reach_the_stacks_prefill():
    args = build_parser().parse_args(["serve", "--prefix-cache-bytes", "0", "--prefix-cache-ttl", "5"])
    args.model = "/m"
    command = stack_commands(args)["prefill"]
    role = build_parser().parse_args(command[command.index("serve"):])
    config = configs.prefill_config(role)
    assert (config.prefix_cache_bytes, config.prefix_cache_ttl_s) == (0, 5.0)
    assert "--prefix-cache-bytes" not in stack_commands(args)["encoder"]


def test_a_negative_grace_period_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "encoder", "--grace-period", "-1"])
    assert "must be >= 0 seconds" in capsys.readouterr().err


def test_the_launcher_imports_no_torch():
    """Everything `epd serve` does before it spawns the services, in a fresh interpreter: parse,
    find the shipped default model, check it, build the children's command lines."""
    code = """
import sys
from epd.cli import serve
from epd.cli.main import build_parser
from epd.model_runtime.loader import check_model_dir, resolve_model_path
args = build_parser().parse_args(["serve"])
args.model = resolve_model_path(args.model)
check_model_dir(args.model)
serve.stack_commands(args)
print(args.model, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    env = {k: v for k, v in child_env().items() if k not in ("EPD_MODEL", "EPD_DEFAULT_MODEL")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(demo_model_dir()), "[]"]
