"""`--linear-kernel onednn`: the model's linear layers through oneDNN for calls of many rows.

torch's own fp32 linear on x86 is MKL's sgemm. On the AMD EPYC bench VM (AVX-512) MKL ran at its
AVX2 speed, ~105 GFLOP/s on one core, where oneDNN (which torch also ships) ran the same product at
~240: 2.1x faster for a prefill or a vision tower call (180-307 rows), but half as fast for a one-row
decode step (docs/benchmarks.md, "oneDNN linear layers"). So with this option a linear layer sends
a call of at least `MIN_ROWS` rows to oneDNN (`torch.ops.mkldnn._linear_pointwise`, the kernel
torch.compile uses on CPU, on the module's own dense weight: no copy), and a smaller one to
`F.linear` as before.

It is for CPUs whose MKL runs below their vector width: on an Intel Xeon with AVX-512 MKL matched
or beat oneDNN (0.81-0.99x), so there the option costs time. Off by default: oneDNN sums in
another order than MKL, so its float32 results differ in the last bits (~5e-6 relative) and a
greedy token can differ from `generate()`'s where the top two logits are within that of each
other. With it on, the tests hold each token to `generate()`'s or to a near tie
(tests/integration/test_onednn_linear.py), as vLLM's CPU backend (oneDNN) is held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_ROWS = 16
"""Rows (tokens or patches) from which a call goes to oneDNN; 16 rows: 1.3x faster, 4: 0.9x,
1: 0.5x (one thread, this model's layer shapes)."""


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on dense tensors: x [..., in] @ weight[out, in].T + bias -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDnnLinear(torch.nn.Linear):
    """An `nn.Linear` whose calls of `MIN_ROWS` rows or more run on oneDNN (same weight, same
    parameters and state dict: `use_onednn_linear` swaps the class of loaded modules)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 2 and x.numel() >= MIN_ROWS * x.shape[-1] and x.is_cpu and not torch.is_grad_enabled():
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_onednn_linear(modules: list[torch.nn.Module]) -> int:
    """Swap every plain `nn.Linear` of `modules` (CPU, float32) for `OneDnnLinear`; returns how many."""
    swapped = 0
    for root in modules:
        for module in root.modules():
            if (
                type(module) is torch.nn.Linear
                and module.weight.is_cpu
                and module.weight.dtype == torch.float32
            ):
                module.__class__ = OneDnnLinear
                swapped += 1
    return swapped
