"""Typed settings for loading and running a model, shared by every stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # lazy: the launcher and the gateway read ModelConfig without torch

_DTYPES = ("float32", "float16", "bfloat16")
LINEAR_KERNELS = ("torch", "onednn")
"""`linear_kernel` values (`--linear-kernel`): torch's own linear, or oneDNN's for calls of many rows."""


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and where to run it (and how long a request's structured output may
    take to compile against its vocabulary)."""

    model: str = "default"
    """Local directory or hub id of a Qwen2-VL / Qwen2.5-VL checkpoint; "default" is epd's
    embedded default model, built (or trained) on first use and cached on disk."""
    device: str = "cpu"
    """"cpu" or "cuda" (or "cuda:N")."""
    dtype: str = "float32"
    """Weights and activations: float32, float16 or bfloat16."""
    num_threads: int = 1
    """torch intra-op threads per model call in this process; 0 ("auto", `epd.model_runtime.threads`):
    every core for a call that serves one request with nothing else waiting, one otherwise."""
    linear_kernel: str = "torch"
    """"torch" (torch's own linear: MKL on x86) or "onednn" (calls of many rows through oneDNN:
    faster on CPUs where MKL is slow, not bit-identical to `generate()`; `epd.model_runtime.onednn_linear`)."""
    structured_compile_timeout_s: float = 30.0
    """How long a request's structured-output constraint may take to compile against the model's
    vocabulary (prefill and decode compile it); longer is refused with INVALID_ARGUMENT saying to
    simplify it (`epd.model_runtime.structured_output.GrammarCompiler.compile`). 0: no bound."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(
                f"linear_kernel must be one of {list(LINEAR_KERNELS)}, got {self.linear_kernel!r}"
            )
        if self.linear_kernel == "onednn" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError("linear_kernel 'onednn' is for --device cpu with --dtype float32")
        if not self.structured_compile_timeout_s >= 0:  # NaN too
            raise ValueError(
                f"structured_compile_timeout_s must be >= 0 (0: no bound), got {self.structured_compile_timeout_s}"
            )
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 1, or 0 for auto; got {self.num_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)
