"""Load the adapter a stage needs, by the checkpoint's model type.

`check_model_dir` is the cheap part (config.json, model type, weights files and their safetensors
headers; no torch): `epd serve` runs it before it starts any service, and `load_adapter` runs it
first too, so that the common broken checkpoints fail with one sentence instead of a traceback
from deep inside transformers (or, for a truncated weights file, a crash while reading it).
This module imports torch only inside `load_adapter`: the launcher imports it.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from epd.model_runtime.default_model import default_model_path
from epd.model_runtime.shared_weights import offered
from epd.model_runtime.threads import num_cores

if TYPE_CHECKING:
    from epd.model_runtime.adapter import VLMAdapter
    from epd.model_runtime.config import ModelConfig

log = logging.getLogger(__name__)

# model_type in config.json -> (module epd.model_runtime.<module>, its adapter class); a new family
# is one entry here plus its file. The every-family tests take their families from here
# (tests/families.py's FAMILIES), so a new one needs a tiny checkpoint (tiny_model.py's TINY_FAMILIES).
_FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLAdapter"),
    "qwen2_5_vl": ("qwen2_vl", "Qwen2VLAdapter"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLAdapter"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeAdapter"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Adapter"),
    "llava_onevision": ("llava_onevision", "LlavaOnevisionAdapter"),
    "glm4v": ("glm4v", "Glm4vAdapter"),
    "internvl": ("internvl", "InternVLAdapter"),
}
# The model parts each stage loads ("all": embedded mode's one model), the same for every family: the
# encoder runs the vision tower, prefill and decode the language model. A family that ever splits
# differently gets its own table here, looked up by model_type.
_STAGE_PARTS: dict[str, frozenset[str]] = {
    "encoder": frozenset({"vision"}),
    "prefill": frozenset({"language"}),
    "decode": frozenset({"language"}),
    "all": frozenset({"vision", "language"}),
}
SUPPORTED = (
    "Qwen2-VL and Qwen2.5-VL checkpoints (model_type qwen2_vl or qwen2_5_vl) "
    "and Qwen3-VL dense and MoE ones (model_type qwen3_vl or qwen3_vl_moe)"
    ", Qwen3.5 (model_type qwen3_5)"
    ", LLaVA-OneVision (model_type llava_onevision)"
    ", GLM-4.1V (model_type glm4v)"
    ", InternVL3 / InternVL3.5 -hf (model_type internvl)"
)

# safetensors refuses headers above 100 MB; a bigger length means the first bytes are not a header.
_MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelLoadError(ValueError):
    """The model cannot be served: missing or unreadable files, an unsupported model type, bad
    weights. A library error like `epd.video.types.MediaError` (this layer cannot import
    `epd.stages.errors`). Its message names the path, the reason and, for a wrong model type,
    what epd serves: for the operator (`epd serve`'s one line, the server log), since
    `epd.transport.errors` answers a client FAILED_PRECONDITION without it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"cannot load {path}: {reason}")
        self.path = path
        self.reason = reason


def family_module(model_type: str | None) -> str | None:
    """The `epd.model_runtime` module that serves `model_type` (None when unknown)."""
    entry = _FAMILIES.get(model_type or "")
    return entry[0] if entry else None


def resolve_model_path(model: str) -> str:
    return str(default_model_path()) if model == "default" else model


def is_hub_id(model: str) -> bool:
    """ "org/name" that is not a local path: downloaded by transformers, so not checked here."""
    return not Path(model).exists() and _HUB_ID.fullmatch(model) is not None


def check_model_dir(path: str) -> str | None:
    """Raise ModelLoadError when the local checkpoint at `path` surely cannot be loaded; return its
    model_type (None for a hub id, which only loading can check). Reads config.json and the
    first bytes of each weights file, nothing more."""
    if is_hub_id(path):
        return None
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(path, "no such directory" if not root.exists() else "not a directory")
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(path, "config.json is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"config.json is not readable JSON ({exc})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in _FAMILIES:
        raise ModelLoadError(path, f"model_type {model_type!r} is not supported; epd serves {SUPPORTED}")
    for weights in _weights_files(root, path):
        if weights.suffix == ".safetensors":
            _check_safetensors(weights, path)
    return model_type


def configured_context_tokens(path: str) -> int | None:
    """The local checkpoint's context as its config.json gives it (the text model's
    `max_position_embeddings`, what the adapters' `context_tokens` read once loaded), without
    loading anything; None for a hub id or a config that does not say (prefill checks once loaded)."""
    if is_hub_id(path):
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # check_model_dir says what is wrong with it
    # The text model's own entry, as get_text_config() reads it; one it leaves out takes its config
    # class's default, which only loading knows.
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    context = text.get("max_position_embeddings")
    return context if isinstance(context, int) else None


def _weights_files(root: Path, path: str) -> list[Path]:
    """The weights files the checkpoint names: one file, or the shards of its index."""
    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if (root / single).is_file():
            return [root / single]
        if (root / index).is_file():
            try:
                shards = sorted(
                    set(json.loads((root / index).read_text(encoding="utf-8"))["weight_map"].values())
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ModelLoadError(path, f"{index} is not a readable weights index ({exc!r})") from None
            missing = [s for s in shards if not (root / s).is_file()]
            if missing:
                raise ModelLoadError(path, f"weights file {missing[0]} named in {index} is missing")
            return [root / s for s in shards]
    raise ModelLoadError(path, "no weights file (model.safetensors or model.safetensors.index.json)")


def _check_safetensors(file: Path, path: str) -> None:
    """The header parses and the file holds every byte it promises: a truncated file is refused
    here rather than found by whatever reads past its end."""
    corrupt = ModelLoadError(path, f"{file.name} is truncated or corrupt")
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise corrupt
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > min(_MAX_SAFETENSORS_HEADER_BYTES, size - 8):
                raise corrupt
            header = json.loads(f.read(header_bytes))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except ModelLoadError:
        raise
    except OSError as exc:
        raise ModelLoadError(path, f"{file.name} is not readable ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise corrupt from None
    if 8 + header_bytes + max(ends, default=0) > size:
        raise corrupt


def load_adapter(config: ModelConfig, stage: str) -> VLMAdapter:
    """stage: "encoder", "prefill", "decode" or "all" (embedded mode loads one model for all).
    Any failure to load is a ModelLoadError saying why (the original exception is its cause)."""
    path = resolve_model_path(config.model)
    model_type = check_model_dir(path)  # before torch: a broken checkpoint fails in milliseconds
    import torch

    torch.set_num_threads(config.num_threads or num_cores())  # 0: auto, cores until a step says less
    try:
        if model_type is None:  # a hub id: its config.json arrives with the download
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(path).model_type
            if model_type not in _FAMILIES:
                raise ModelLoadError(
                    path, f"model_type {model_type!r} is not supported; epd serves {SUPPORTED}"
                )
        log.info("loading %s (%s) for %s on %s", path, model_type, stage, config.device)
        module_name, class_name = _FAMILIES[model_type]
        module = importlib.import_module(f"epd.model_runtime.{module_name}")
        # The zygote's shared weights (epd/model_runtime/shared_weights.py) as they are, on the CPU:
        # a kernel that repacks them, or a GPU, gets the process's own.
        with offered(config.device == "cpu" and config.linear_kernel == "torch"):
            adapter = getattr(module, class_name)(path, config, set(_STAGE_PARTS[stage]))
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers/torch raise, the model cannot be served
        log.debug("loading %s failed", path, exc_info=True)
        raise ModelLoadError(path, f"{type(exc).__name__}: {_first_line(exc)}") from exc
    if config.linear_kernel == "onednn":
        _use_onednn(adapter, path)
    if config.device == "cpu":
        from epd.model_runtime.mkl_kernels import mkl_kernels_note

        if note := mkl_kernels_note():
            log.info("%s", note)
    return adapter


def _use_onednn(adapter: VLMAdapter, path: str) -> None:
    """`--linear-kernel onednn`: the linear layers of every model part the adapter holds."""
    import torch

    from epd.model_runtime.onednn_linear import onednn_available, use_onednn_linear

    if not onednn_available():
        raise ModelLoadError(path, "--linear-kernel onednn: this torch build has no oneDNN linear kernel")
    parts = [v for v in vars(adapter).values() if isinstance(v, torch.nn.Module)]
    log.info("linear kernel: oneDNN for calls of many rows (%d linear layers)", use_onednn_linear(parts))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
