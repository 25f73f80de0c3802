"""`--linear-kernel onednn` with the real tiny Qwen2-VL and Qwen2.5-VL (no servers):

- a linear layer sends a call of 16 rows or more to oneDNN (a spy on torch's kernel counts them),
  a smaller one to `F.linear` bit for bit, and the loader swaps every linear layer of the parts it
  loads, keeping their weights;
- end to end (embedded pipeline), each request's greedy tokens equal `generate()`'s on the stock
  model (torch's own linear), or first differ where generate() preferred its own token by at most
  NEAR_TIE_LOGITS: oneDNN sums in another order, so float32 rounding may flip a near tie, never more;
- the option is refused where it has no kernel to use (another device or dtype).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime import onednn_linear
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.onednn_linear import MIN_ROWS, OneDnnLinear
from tests.embedded import ask_tokens
from tests.reference import decode_for_test, divergence_margin, reference_tokens

QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 16
REQUESTS = [("mp4", 8), ("mp4_b", 6), ("mp4", 4), ("png", 1)]  # (media, num_frames)
NEAR_TIE_LOGITS = 1e-3
"""Largest logit margin between generate()'s token and ours that counts as a rounding near tie."""


def test_calls_of_many_rows_go_to_onednn_and_small_ones_stay_bit_for_bit(monkeypatch):
    calls: list[tuple[int, ...]] = []
    kernel = onednn_linear._onednn_linear

    def spy(x, weight, bias):
        calls.append(tuple(x.shape))
        return kernel(x, weight, bias)

    monkeypatch.setattr(onednn_linear, "_onednn_linear", spy)
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    reference = torch.nn.Linear(64, 48)
    reference.load_state_dict(layer.state_dict())
    assert onednn_linear.use_onednn_linear([layer]) == 1 and type(layer) is OneDnnLinear
    with torch.inference_mode():
        small = torch.randn(1, MIN_ROWS - 1, 64)
        assert torch.equal(layer(small), reference(small)) and calls == []
        wide = torch.randn(2, MIN_ROWS, 64)
        torch.testing.assert_close(layer(wide), reference(wide), rtol=1e-5, atol=1e-5)
    assert calls == [(2, MIN_ROWS, 64)]
    with torch.enable_grad():  # training: torch's own linear (oneDNN's has no backward here)
        layer(torch.randn(2, MIN_ROWS, 64))
    assert len(calls) == 1


def test_the_loader_swaps_every_linear_layer_of_the_loaded_parts(tiny_models):
    plain = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "all")
    fast = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"]), linear_kernel="onednn"), "all")

    def linears(adapter, cls):
        return {
            name: m
            for part in ("model", "visual")
            for name, m in getattr(adapter, part).named_modules()
            if type(m) is cls
        }

    assert linears(plain, OneDnnLinear) == {}
    swapped = linears(fast, OneDnnLinear)
    assert len(swapped) == len(linears(plain, torch.nn.Linear)) > 0 and linears(fast, torch.nn.Linear) == {}
    for name, module in linears(plain, torch.nn.Linear).items():
        assert torch.equal(swapped[name].weight, module.weight), name


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_tokens_equal_generate_or_differ_first_at_a_near_tie(tiny_models, media_files, family):
    model_dir = tiny_models[family]
    model = ModelConfig(model=str(model_dir), linear_kernel="onednn")
    no_cache = TokenCacheConfig(memory_budget_bytes=0)
    pipeline = build_embedded_pipeline(model, encoder=EncoderConfig(model=model, cache=no_cache))
    try:
        got = [
            asyncio.run(ask_tokens(pipeline, media_files[m], QUESTION, n, MAX_NEW_TOKENS))
            for m, n in REQUESTS
        ]
    finally:
        pipeline.close()
    for (media, num_frames), tokens in zip(REQUESTS, got, strict=True):
        video = decode_for_test(media_files[media], num_frames)
        want = reference_tokens(model_dir, video, QUESTION, MAX_NEW_TOKENS)  # stock torch linear
        assert len(want) >= 8 and len(set(want)) > 2, "the reference says too little to compare"
        margin = divergence_margin(model_dir, video, QUESTION, want, tokens)
        assert margin is None or margin[1] <= NEAR_TIE_LOGITS, (
            f"{family} {media} x {num_frames} frames with oneDNN: token {margin and margin[0]} differs from "
            f"generate()'s by a logit margin of {margin and margin[1]}: not a rounding near tie"
        )


@pytest.mark.parametrize("bad", [{"device": "cuda"}, {"dtype": "bfloat16"}, {"linear_kernel": "fast"}])
def test_the_option_is_refused_where_it_has_no_kernel(bad):
    with pytest.raises(ValueError, match="linear_kernel"):
        ModelConfig(**({"linear_kernel": "onednn"} | bad))
