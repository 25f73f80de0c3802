"""An accelerator's device rules on a CPU-only machine, for tests of code that must run on a GPU.

`on_device(t)` wraps a CPU tensor so that it says it lives on another device (`t.device` is
`meta`) while keeping its values; inside `with SimulatedDevice():` every op on such tensors runs on
their CPU values and raises, as CUDA does, when it mixes them with CPU tensors:

* elementwise ops, cat, gather, scatter, index_add, masked_fill, where ...: every tensor argument
  must be on the same device, except 0-dim CPU tensors (CUDA takes those as scalars);
* indexing (`x[i]`, `x[i] = v`): a device tensor takes CPU indices, a CPU tensor does not take
  device indices.

Factories follow their `device=` argument: `torch.zeros(n, device=x.device)` makes a simulated
device tensor and `torch.zeros(n)` a CPU one, so a work tensor created without `device=` and then
combined with the model's tensors raises here as it would on CUDA.

Why not the `meta` device itself: meta tensors have no values, so nothing data-dependent runs
(nonzero, unique, sort-then-select, `int(t)`), and meta kernels accept some CPU/meta mixes that
CUDA refuses (a CPU tensor scattered into from a meta one). A model's parameters and buffers can be
moved too (`move_module`), so a real transformers model runs "on the device" here, slowly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE = torch.device("meta")
_CPU = torch.device("cpu")
_aten = torch.ops.aten
_INDEX_OPS = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}


class DeviceTensor(torch.Tensor):
    """CPU values (`elem`) that report `DEVICE`; only usable inside `SimulatedDevice`."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceTensor:
        if type(elem) is not torch.Tensor or elem.device != _CPU:
            raise TypeError(f"wrap a plain CPU tensor, not a {type(elem).__name__} on {elem.device}")
        t = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device=DEVICE, requires_grad=False,
        )  # fmt: skip
        t.elem = elem
        return t

    def tolist(self) -> Any:  # as on CUDA: the values come back to Python
        return self.elem.tolist()

    def __repr__(self) -> str:
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a DeviceTensor outside `with SimulatedDevice():`")


def on_device(t: torch.Tensor) -> DeviceTensor:
    return DeviceTensor(t)


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """The values of a (possibly simulated-device) tensor, as a plain CPU tensor."""
    return t.elem if isinstance(t, DeviceTensor) else t


def is_on_device(t: torch.Tensor) -> bool:
    return isinstance(t, DeviceTensor)


def move_module(module: torch.nn.Module) -> None:
    """Every parameter and buffer of `module` onto the simulated device (in place)."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = DeviceTensor(p.data)  # type: ignore[assignment]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = DeviceTensor(b)


def _mixes_devices(func, args: tuple, kwargs: dict) -> bool:
    checked: list[Any] = [args, kwargs]
    if func in _INDEX_OPS and isinstance(args[0], DeviceTensor):  # (self, indices, [values, ...])
        indices = [i for i in pytree.tree_leaves(args[1]) if isinstance(i, DeviceTensor)]  # CPU ones are fine
        checked = [args[0], indices, list(args[2:]), kwargs]
    leaves = [t for t in pytree.tree_leaves(checked) if isinstance(t, torch.Tensor)]
    kinds = {isinstance(t, DeviceTensor) for t in leaves if isinstance(t, DeviceTensor) or t.dim() > 0}
    return len(kinds) > 1


class SimulatedDevice(TorchDispatchMode):
    """Runs the ops of `DeviceTensor`s on their CPU values with CUDA's device checks."""

    _FACTORIES = ("tensor", "as_tensor")

    def __enter__(self):
        # torch.tensor(data, device=...) copies below the dispatch modes, so it is caught here.
        self._saved = {name: getattr(torch, name) for name in self._FACTORIES}
        for name, make in self._saved.items():

            def factory(data, *args, device=None, _make=make, **kwargs):
                if device is not None and torch.device(device) == DEVICE:
                    return DeviceTensor(_make(data, *args, **kwargs))
                return _make(data, *args, device=device, **kwargs)

            setattr(torch, name, factory)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, make in self._saved.items():
            setattr(torch, name, make)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _mixes_devices(func, args, kwargs):
            raise RuntimeError(
                f"{func}: expected all tensors to be on the same device, found the device and cpu"
            )
        devices = [d for d in pytree.tree_leaves((args, kwargs)) if isinstance(d, torch.device)]
        to_device = any(d == DEVICE for d in devices)
        from_device = any(isinstance(t, DeviceTensor) for t in pytree.tree_leaves((args, kwargs)))
        wrapped = {id(t.elem): t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, DeviceTensor)}
        args, kwargs = pytree.tree_map_only(
            torch.device, lambda d: _CPU if d == DEVICE else d, (args, kwargs)
        )
        args, kwargs = pytree.tree_map_only(DeviceTensor, lambda t: t.elem, (args, kwargs))
        out = func(*args, **kwargs)
        # The result is on the device when asked for (device=DEVICE), or when made from device
        # tensors without naming a device; an in-place op returns the tensor it was given.
        if not (to_device or (from_device and not devices)):
            return out
        return pytree.tree_map_only(
            torch.Tensor, lambda t: wrapped[id(t)] if id(t) in wrapped else DeviceTensor(t), out
        )
