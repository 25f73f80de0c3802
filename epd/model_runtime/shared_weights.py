"""A checkpoint's tensors loaded once, by the stack's zygote, and shared copy-on-write by every model
service it forks (epd/cli/zygote.py; the zygote runs `preload_from_env` via epd/cli/zygote_weights.py).

Why: each service used to read the checkpoint into tensors of its own, so prefill, decode and every
replica held a private copy of the language model's weights (~87 MiB a stage process on the 27M
bench model, ~15 GB on a 7B one). Loaded before the fork, the pages are the zygote's; a forked
service that assigns them to its parameters (`load_state_dict(assign=True)`, no copy) maps the same
physical pages until something writes to them, which nothing does: inference reads weights.

The tensors are fresh torch allocations (64-byte aligned, like any torch CPU tensor), not views of
the file: safetensors' memory-mapped tensors are only 8-byte aligned, and on them the CPU kernels
rounded a batch's rows differently from one row's (an earlier try, taken back). Floating tensors are
converted to the stack's dtype here, as `load_state_dict` converted them into the parameters.

The store is keyed by (the checkpoint directory, resolved; the dtype; each weights file's name,
size, mtime, inode and device): a service of another model or dtype, or one started after the file
changed, finds nothing and reads the files as before (`shared_part` None). So does a load that would
transform the weights (`offered(False)`: --linear-kernel onednn, a GPU), and a part whose parameters
want another floating dtype than the one stored (`assignable` None): converting the stored copy
again could round twice.

The zygote must run no thread when it forks (epd/cli/zygote.py): the files are read with plain
reads, and a dtype conversion copies at most torch's grain size of elements at a time, which torch
runs on the calling thread (a bigger copy starts its OpenMP pool).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WEIGHTS_ENV = "EPD_ZYGOTE_WEIGHTS"
"""The checkpoint the zygote preloads (`SharedWeights.env_value`), in its environment only."""
_GRAIN_ELEMENTS = 32_768
"""torch's GRAIN_SIZE: a copy of fewer elements runs on the calling thread, whatever the threads."""
_READ_CHUNK_BYTES = 64 << 20
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

StoreKey = tuple[str, str, tuple[tuple[str, int, int, int, int], ...]]
_STORE: dict[StoreKey, dict[str, torch.Tensor]] = {}
_SHARED_IDS: set[int] = set()
"""id() of every stored tensor: `assignable` assigns only those (the store keeps them alive)."""
_OFFERED: contextvars.ContextVar[bool] = contextvars.ContextVar("epd_shared_weights_offered", default=True)


@dataclass(frozen=True)
class SharedWeights:
    """What the launcher asks the zygote to preload: the checkpoint (a local directory, or a hub id
    already downloaded) in `dtype` ("float32", "float16", "bfloat16")."""

    model: str
    dtype: str

    def env_value(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype})


def store_key(root: Path, files: list[str], dtype: str) -> StoreKey:
    """The store's key of the checkpoint `files` in `root` read in `dtype` (OSError: a file is gone)."""
    identity = []
    for name in files:
        st = (root / name).stat()
        identity.append((name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
    return (str(root.resolve()), dtype, tuple(identity))


def preload(root: Path, files: list[str], dtype: str) -> int:
    """Read every tensor of the safetensors `files` in `root` into the store (floating ones in
    `dtype`); returns their bytes. A file that changed while it was read stores nothing (its
    services would not find it anyway)."""
    import torch

    key = store_key(root, files, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(read_safetensors(root / name, getattr(torch, dtype)))
    if store_key(root, files, dtype) != key:
        return 0
    _STORE[key] = tensors
    _SHARED_IDS.update(id(t) for t in tensors.values())
    return sum(t.nbytes for t in tensors.values())


def preload_from_env() -> None:
    """In the zygote: preload the checkpoint named in $EPD_ZYGOTE_WEIGHTS, if any. A failure is one
    warning: the services then read the files themselves (and report what is wrong with them)."""
    value = os.environ.get(WEIGHTS_ENV)
    if not value:
        return
    try:
        wanted = SharedWeights(**json.loads(value))
        root = _local_checkpoint(wanted.model)
        if root is None:
            log.warning(
                "epd: %s is not downloaded yet: each model service loads its own weights", wanted.model
            )
            return
        from epd.model_runtime.hf_loading import safetensors_files

        _, files = safetensors_files(str(root))
        if files:
            preload(root, files, wanted.dtype)
    except Exception as exc:  # noqa: BLE001 - the zygote must fork the services whatever the checkpoint
        log.warning("epd: the weights were not preloaded for sharing (%s: %s)", type(exc).__name__, exc)


def _local_checkpoint(model: str) -> Path | None:
    """The directory of `model`: itself, or a hub id's downloaded snapshot (the zygote downloads
    nothing: a service does, and the next stack shares it)."""
    if Path(model).is_dir():
        return Path(model)
    from epd.model_runtime.hf_loading import _hub_snapshot

    return _hub_snapshot(model)


def read_safetensors(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file, each in a fresh torch allocation (floating ones in
    `dtype`), read with plain reads on this thread."""
    import torch

    out = {}
    with file.open("rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            stored = getattr(torch, _SAFETENSORS_DTYPES[entry["dtype"]])
            begin, end = entry["data_offsets"]
            tensor = torch.empty(entry["shape"], dtype=stored)
            if tensor.nbytes != end - begin:
                raise ValueError(f"{file.name}: {name} holds {end - begin} bytes, not {tensor.nbytes}")
            f.seek(8 + header_bytes + begin)
            _read_into(f, tensor)
            out[name] = _converted(tensor, dtype) if tensor.is_floating_point() else tensor
    return out


def _read_into(f, tensor: torch.Tensor) -> None:
    import torch

    view = tensor.reshape(-1).view(torch.uint8).numpy().data  # the tensor's own bytes
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + _READ_CHUNK_BYTES])
        if not n:
            raise ValueError(f"{f.name} is truncated")
        done += n


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, converted as `copy_` converts into a parameter, a grain at a time."""
    import torch

    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype)
    src, dst = tensor.reshape(-1), out.reshape(-1)
    for start in range(0, src.numel(), _GRAIN_ELEMENTS):
        dst[start : start + _GRAIN_ELEMENTS].copy_(src[start : start + _GRAIN_ELEMENTS])
    return out


@contextlib.contextmanager
def offered(allowed: bool) -> Iterator[None]:
    """Within: `shared_part` finds nothing unless `allowed` (a load that will transform the weights
    after it reads them, or move them to a GPU, reads its own)."""
    token = _OFFERED.set(allowed)
    try:
        yield
    finally:
        _OFFERED.reset(token)


def shared_part(
    root: Path, files: list[str], dtype: torch.dtype, rename: Callable[[str], str | None]
) -> dict[str, torch.Tensor] | None:
    """The stored tensors of this checkpoint in `dtype` that `rename` maps to a name (by that
    name), or None where the store has none (another checkpoint or dtype, a changed file, a
    process not forked from a zygote that preloaded it)."""
    if not _STORE or not _OFFERED.get():
        return None
    try:
        key = store_key(root, files, str(dtype).removeprefix("torch."))
    except OSError:
        return None
    tensors = _STORE.get(key)
    if tensors is None:
        return None
    return {new: tensor for name, tensor in tensors.items() if (new := rename(name)) is not None}


def assignable(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """`state` (from `shared_part`, perhaps rearranged) as `load_state_dict(assign=True)` should
    take it: a stored tensor that matches its parameter's dtype, shape and strides as it is (shared);
    any other (a transposed copy) copied into a fresh tensor of the parameter's layout, as
    `load_state_dict` would copy it (one copy per source tensor, so tied parameters stay one).
    None when a floating tensor's dtype differs from its parameter's (kept in float32, say):
    converting the stored, converted copy again could round twice, so the part reads the files."""
    import torch

    own = module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    copies: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        target = own.get(name)
        if target is None or tensor.shape != target.shape:
            out[name] = tensor  # load_state_dict reports it (unexpected, size mismatch)
            continue
        if tensor.is_floating_point() and tensor.dtype != target.dtype:
            return None
        if id(tensor) in _SHARED_IDS and tensor.dtype == target.dtype and tensor.stride() == target.stride():
            out[name] = tensor
            continue
        if id(tensor) not in copies:
            with torch.no_grad():
                copies[id(tensor)] = torch.empty_like(target, requires_grad=False).copy_(tensor)
        out[name] = copies[id(tensor)]
    return out


def shared_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of the stored tensors among `state`'s values (each once)."""
    stored = {id(t): t for t in state.values() if id(t) in _SHARED_IDS}
    return sum(t.nbytes for t in stored.values())
