"""The model check `epd serve` runs before it starts anything (`check_model_dir`, in
epd/model_runtime/loader.py): the checkpoint's config and weights, read without loading them, with
messages that name the file; and what a service answers when its model cannot load."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import pytest

from epd.model_runtime.loader import ModelLoadError, check_model_dir
from epd.resources import demo_model_dir
from epd.transport.errors import status_of


def _safetensors(path: Path, data_bytes: int, written_bytes: int | None = None) -> None:
    """A safetensors file of one float32 tensor: 8-byte header length, JSON header, data."""
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}}
    ).encode()
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
    with pytest.raises(
        ModelLoadError, match="model-2.safetensors named in model.safetensors.index.json is missing"
    ):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64, written_bytes=60)
    with pytest.raises(ModelLoadError, match="model-2.safetensors is truncated or corrupt"):
        check_model_dir(str(root))
    _safetensors(root / "model-2.safetensors", 64)
    assert check_model_dir(str(root)) == "qwen2_vl"


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "truncated or corrupt"),  # empty
        (struct.pack("<Q", 1 << 40) + b"{}", "truncated or corrupt"),  # header longer than the file
        (struct.pack("<Q", 5) + b"nope!", "truncated or corrupt"),  # header not JSON
    ],
)
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


def test_a_model_that_cannot_load_is_a_failed_precondition_without_its_path():
    """What a service answers instead of INTERNAL; the path and the reason are the server log's
    (`rpc_errors`), not the client's: they reached clients with the status."""
    code, message = status_of(ModelLoadError("/srv/m", "model_type 'llama' is not supported; epd serves X"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert message == "the server cannot load its model; its operator must fix it (the server log says why)"
