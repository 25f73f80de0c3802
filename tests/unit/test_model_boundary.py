"""Only the family files touch a model's modules (issue 14, item 1): every stage and every pruning
stage reaches the model through `VLMAdapter` (epd/model_runtime/adapter.py, "pruning interface").

The check reads the source (AST) of every epd module outside epd/model_runtime/ and fails on an
attribute access, or a `getattr(x, "name")`, whose name belongs to a transformers model's insides
(`language_model`, `embed_tokens`, `lm_head`, `self_attn`, `q_proj`, `rotary_emb`, ...), on
`.model.model`, and on forward hooks. What cannot move is allow-listed below with its reason.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

EPD = Path(__file__).resolve().parents[2] / "epd"
FAMILY_CODE = "epd.model_runtime"  # adapter.py and one file per family: the only code allowed in

MODEL_INTERNALS = frozenset({
    "language_model", "embed_tokens", "lm_head", "text_config", "rotary_emb", "self_attn",
    "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "input_layernorm",
    "post_attention_layernorm", "decoder_layers", "register_forward_pre_hook", "register_forward_hook",
})  # fmt: skip

# (module prefix) -> why it may touch model internals. Keep it short and give a reason.
ALLOWED = {
    "epd.train": "training builds, initialises and trains the transformers model itself (no serving stage)",
    "epd.bench.bench_decode_batch": (
        "its 'gather' baseline re-batches transformers' own DynamicCaches outside the adapter on purpose, "
        "to time what a server without a batch cache would do"
    ),
}

# (module, access as `model_accesses` names it) -> why it is still there.
ALLOWED_ACCESSES: dict[tuple[str, str], str] = {}


def epd_modules() -> dict[str, Path]:
    """Module name -> file, through the symlinks that put the top-level folders under epd/."""
    modules = {}
    files = [
        Path(d) / f for d, _, names in os.walk(EPD, followlinks=True) for f in names if f.endswith(".py")
    ]
    for path in sorted(files):
        rel = path.relative_to(EPD.parent).with_suffix("")
        if "_pb2" in rel.name or any(p in ("models", "samples") for p in rel.parts):
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules[".".join(parts)] = path
    return modules


def model_accesses(source: str) -> list[str]:
    """'line N: .name' for every access to a model's insides in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in MODEL_INTERNALS:
                found.append(f"line {node.lineno}: .{node.attr}")
            elif (
                node.attr == "model" and isinstance(node.value, ast.Attribute) and node.value.attr == "model"
            ):
                found.append(f"line {node.lineno}: .model.model")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in MODEL_INTERNALS
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


MODULES = epd_modules()
CHECKED = sorted(m for m in MODULES if not m.startswith(FAMILY_CODE) and not m.startswith(tuple(ALLOWED)))


def test_the_walk_sees_the_pruning_code_and_skips_the_family_files():
    assert {
        "epd.token_pruning.layerwise_prefill",
        "epd.prefill_svc.pruned_prefill",
        "epd.decode_svc.eviction",
        "epd.encoder_svc.pruning",
        "epd.bench.bench_pruning",
    } <= set(CHECKED)
    assert "epd.model_runtime.qwen2_vl" in MODULES and "epd.model_runtime.qwen2_vl" not in CHECKED


def test_every_allowance_still_names_a_module():
    for prefix in ALLOWED:
        assert any(m == prefix or m.startswith(prefix + ".") for m in MODULES), f"stale allowance: {prefix}"
    for module, access in ALLOWED_ACCESSES:
        found = [f.split(": ", 1)[1] for f in model_accesses(MODULES[module].read_text(encoding="utf-8"))]
        assert access in found, f"stale allowance: {module} no longer has {access}; remove it"


@pytest.mark.parametrize("module", CHECKED)
def test_only_family_files_touch_model_internals(module):
    allowed = {access for mod, access in ALLOWED_ACCESSES if mod == module}
    found = [
        f
        for f in model_accesses(MODULES[module].read_text(encoding="utf-8"))
        if f.split(": ", 1)[1] not in allowed
    ]
    assert found == [], (
        f"{module} reaches into the model ({'; '.join(found)}): add a method to VLMAdapter "
        "(epd/model_runtime/adapter.py) and implement it in the family files"
    )


def test_the_check_catches_what_the_pruning_code_used_to_do():
    """Negative control: the accesses the old pruning code made are all found."""
    old = """
lm = adapter.language_model
hidden = lm.embed_tokens(ids)
cos, sin = lm.rotary_emb(hidden, rows)
q = getattr(layer.self_attn, "q_proj")(hidden)
layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
logits = adapter.lm_head(hidden)
tower = adapter.model.model.visual
sizes = ModelSizes.from_config(adapter.text_config)
"""
    found = model_accesses(old)
    for name in (
        ".language_model",
        ".embed_tokens",
        ".rotary_emb",
        "getattr(..., 'q_proj')",
        ".self_attn",
        ".register_forward_pre_hook",
        ".lm_head",
        ".model.model",
        ".text_config",
    ):
        assert any(f.endswith(name) for f in found), (name, found)
    assert model_accesses("adapter.embed(ids)\nadapter.logits(h)\nadapter.num_layers\nstate.visual\n") == []
