"""The zygote's store of preloaded weights (epd/model_runtime/shared_weights.py): what it serves, to
whom, and that a stage loaded from it has the same weights as one that read the files, in
64-byte-aligned memory that is the store's own. Processes sharing its pages:
tests/integration/test_shared_weights.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from epd.model_runtime import shared_weights
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import language_key, safetensors_files
from epd.model_runtime.loader import load_adapter
from tests.stack import ROOT, child_env


@pytest.fixture
def store():
    """The store, emptied again after the test (this process is no zygote)."""
    yield shared_weights
    shared_weights._STORE.clear()
    shared_weights._SHARED_IDS.clear()


def _preload(model, dtype: str = "float32") -> int:
    root, files = safetensors_files(str(model))
    return shared_weights.preload(root, files, dtype)


def _part(model, dtype: torch.dtype, rename=language_key):
    root, files = safetensors_files(str(model))
    return shared_weights.shared_part(root, files, dtype, rename)


def test_the_store_serves_its_checkpoint_in_its_dtype_only(tiny_models, store):
    model = tiny_models["qwen2_vl"]
    assert _part(model, torch.float32) is None  # nothing preloaded: a process not forked from a zygote
    assert _preload(model) > 0
    language = _part(model, torch.float32)
    assert language and all(name.startswith(("model.language_model.", "lm_head.")) for name in language)
    assert _part(model, torch.bfloat16) is None
    assert _part(model, torch.float16) is None
    assert _part(tiny_models["qwen2_5_vl"], torch.float32) is None  # another checkpoint
    with shared_weights.offered(False):  # --linear-kernel onednn, a GPU
        assert _part(model, torch.float32) is None
    assert _part(model, torch.float32) is not None


def test_a_weights_file_changed_after_the_preload_is_read_again(tiny_models, tmp_path, store):
    import shutil

    model = shutil.copytree(tiny_models["qwen2_vl"], tmp_path / "model")
    _preload(model)
    assert _part(model, torch.float32) is not None
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # re-saved: same size
    assert _part(model, torch.float32) is None
    _preload(model)  # a new zygote's
    replaced = model / "replaced.safetensors"
    shutil.copy2(weights, replaced)  # the same bytes and mtime, another file
    os.replace(replaced, weights)
    assert _part(model, torch.float32) is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stored_tensors_are_the_files_in_the_dtype_and_aligned(tiny_models, store, dtype):
    """As `load_state_dict` would convert them into parameters of `dtype`; in fresh torch memory."""
    model = tiny_models["qwen2_vl"]
    _preload(model, dtype)
    stored = _part(model, getattr(torch, dtype), rename=lambda key: key)
    root, files = safetensors_files(str(model))
    with safe_open(str(root / files[0]), framework="pt") as f:
        assert sorted(stored) == sorted(f.keys())
        for key in f.keys():
            want = f.get_tensor(key)
            want = want.to(getattr(torch, dtype)) if want.is_floating_point() else want
            assert stored[key].dtype == want.dtype and torch.equal(stored[key], want), key
            assert stored[key].data_ptr() % 64 == 0, key


@pytest.mark.parametrize("stage", ["prefill", "encoder"])
def test_a_stage_loaded_from_the_store_holds_the_stores_tensors_and_the_same_weights(
    tiny_models, store, stage
):
    model = str(tiny_models["qwen2_vl"])
    config = ModelConfig(model=model, num_threads=1)
    own = load_adapter(config, stage)
    _preload(model)
    shared = load_adapter(config, stage)
    part = (shared.model, own.model) if stage == "prefill" else (shared.visual, own.visual)
    stored = {t.data_ptr() for t in _part(model, torch.float32, rename=lambda key: key).values()}
    want = part[1].state_dict()
    got = part[0].state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    params = dict(part[0].named_parameters(remove_duplicate=False))
    assert params and all(p.data_ptr() in stored for p in params.values()), "a parameter is a copy"
    assert all(p.data_ptr() not in stored for p in part[1].parameters())
    if stage == "prefill":  # a head tied to the embeddings is one parameter, as read from the files

        def tied(model) -> bool:
            return model.lm_head.weight is model.model.language_model.embed_tokens.weight

        assert tied(shared.model) == tied(own.model)


def test_onednn_linear_layers_read_their_own_weights(tiny_models, store):
    """`--linear-kernel onednn` repacks the weights it runs: its stage reads the files."""
    model = str(tiny_models["qwen2_vl"])
    _preload(model)
    stored = {t.data_ptr() for t in _part(model, torch.float32, rename=lambda key: key).values()}
    try:
        adapter = load_adapter(ModelConfig(model=model, num_threads=1, linear_kernel="onednn"), "prefill")
    except Exception as exc:  # noqa: BLE001 - a torch without oneDNN's linear
        pytest.skip(str(exc))
    assert not any(p.data_ptr() in stored for p in adapter.model.parameters())


def test_preloading_starts_no_thread(tmp_path):
    """The zygote forks with no thread of its own (epd/cli/zygote.py): converting a tensor bigger
    than torch's grain size in one copy started torch's OpenMP threads in it."""
    from safetensors.torch import save_file

    save_file({"w": torch.randn(400, 400), "b": torch.randn(400)}, str(tmp_path / "model.safetensors"))
    code = (
        "import os, sys, torch\n"
        "from pathlib import Path\n"
        "from epd.model_runtime.shared_weights import preload\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        f"preload(Path({str(tmp_path)!r}), ['model.safetensors'], 'bfloat16')\n"
        "sys.exit(len(os.listdir('/proc/self/task')) - before)\n"
    )
    env = child_env()
    env["OMP_NUM_THREADS"] = "4"  # torch's threads, whatever the machine's cores
    env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's own threads are not what this counts
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"{proc.returncode} threads started: {proc.stderr}"


def test_a_head_tied_to_the_embeddings_stays_one_parameter_over_the_stored_tensor(
    tiny_models, tmp_path, store
):
    """A checkpoint that ties the head stores no lm_head: both become the stored embeddings, one
    parameter again after the assignment (as a load from the files leaves them)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model = shutil.copytree(tiny_models["qwen2_vl"], tmp_path / "tied")
    tensors = load_file(model / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config.get("text_config", {})["tie_word_embeddings"] = True
    (model / "config.json").write_text(json.dumps(config))
    _preload(model)
    stored = {t.data_ptr() for t in _part(model, torch.float32, rename=lambda key: key).values()}
    adapter = load_adapter(ModelConfig(model=str(model), num_threads=1), "decode")
    embeddings = adapter.model.model.language_model.embed_tokens.weight
    assert adapter.model.lm_head.weight is embeddings and embeddings.data_ptr() in stored
