"""Qwen3-VL MoE (model_type qwen3_vl_moe, transformers' `Qwen3VLMoeForConditionalGeneration`)
behind `VLMAdapter`: `Qwen3VLAdapter` with the MoE family's transformers classes.

What differs from dense Qwen3-VL, in transformers 5.x, is the language model's MLP only: each
sparse layer's MLP is a router (`mlp.gate.weight` [experts, hidden]) choosing
`num_experts_per_tok` experts per token, whose weights are stacked 3-D tensors
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). The tower, DeepStack, the processor,
M-RoPE and the KV cache (attention layers only, the same shapes) are dense Qwen3-VL's, so the
encoder's output and everything that crosses Encode -> Prefill -> Decode is the same.
Routing is per token, so batched, padded and chunked prefill and batched decode route each
token as a forward over its own request does.

Loading: the hub's checkpoints store an expert tensor as [experts, in, out] and transformers'
loader transposes it to the model's [experts, out, in] (conversion_mapping "qwen3_vl_moe":
`Transpose(1, 2, check_dims=True)`), while `save_pretrained` writes the model's layout. The
one-part language loader reads tensors itself, so it applies the same rule: transpose an expert
tensor whose shape is not its parameter's, keep one that matches.
"""

from __future__ import annotations

from typing import Any

import torch

from epd.model_runtime.adapter import TextDims
from epd.model_runtime.hf_loading import (
    build_language_only,
    language_key,
    load_language_model,
    load_language_state,
    safetensors_files,
)
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter

_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    """Dense Qwen3-VL's adapter on the MoE classes. Pruning as dense: the encoder stages it
    supports see the same tower and DeepStack features; the refused ones are refused for
    DeepStack, which MoE does not change."""

    family = "qwen3_vl_moe"
    family_label = "Qwen3-VL MoE"

    def _hf_classes(self) -> tuple[Any, Any, Any]:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeModel,
            Qwen3VLMoeTextModel,
            Qwen3VLMoeVisionModel,
        )

        return Qwen3VLMoeModel, Qwen3VLMoeVisionModel, Qwen3VLMoeTextModel

    def _load_language_model(self, path: str, hf_config, dtype: torch.dtype):
        """The text model (router and experts included) and lm_head alone; the tower's tensors are
        never read. Without safetensors: the full model (transformers converts), tower dropped."""
        root, files = safetensors_files(path)
        text_cls = self._hf_classes()[2]
        if not files:
            return load_language_model(path, hf_config, dtype, text_cls)
        text_config = hf_config.text_config
        model = build_language_only(
            text_config, dtype, lambda: text_cls._from_config(text_config, dtype=dtype)
        )
        load_language_state(
            model,
            root,
            files,
            language_key,
            hf_config,
            path,
            dtype,
            lambda state: _experts_in_model_layout(state, model),
        )
        return model

    @property
    def text_dims(self) -> TextDims:
        """Dense Qwen3-VL's, with `intermediate_size` the MLP width a token runs through on average
        over the layers (the prefill FLOPs estimate): top-k experts' in a sparse layer, the dense
        MLP's in a `mlp_only_layers` one. The cost of the router is left out."""
        dims = super().text_dims
        c = self.hf_config.text_config
        widths = [
            c.num_experts_per_tok * c.moe_intermediate_size if _is_sparse(c, i) else c.intermediate_size
            for i in range(c.num_hidden_layers)
        ]
        return TextDims(
            dims.num_layers,
            dims.hidden_size,
            round(sum(widths) / len(widths)),
            dims.num_heads,
            dims.num_kv_heads,
            dims.head_dim,
        )


def _is_sparse(text_config, layer: int) -> bool:
    """Whether decoder layer `layer` has the MoE block, by the decoder layer's own rule."""
    c = text_config
    return layer not in c.mlp_only_layers and c.num_experts > 0 and (layer + 1) % c.decoder_sparse_step == 0


def _experts_in_model_layout(
    state: dict[str, torch.Tensor], model: torch.nn.Module
) -> dict[str, torch.Tensor]:
    """`state` with every expert tensor in the parameter's layout: one of the hub's layout
    ([experts, in, out]) transposed, as transformers' loader does; a matching one kept."""
    params = dict(model.named_parameters())
    for name, tensor in state.items():
        param = params.get(name)
        if name.endswith(_EXPERT_TENSORS) and param is not None and tensor.shape != param.shape:
            state[name] = tensor.transpose(1, 2).contiguous()
    return state
