"""Qwen3.5 behind `VLMAdapter`, on transformers' own `Qwen3_5ForConditionalGeneration`.

What differs from Qwen3-VL (`qwen3_vl.py`), and is reproduced here exactly as transformers 5.x does:
  * The language model is hybrid: `text_config.layer_types` mixes "linear_attention" layers
    (Gated DeltaNet) with gated "full_attention" layers (one in four on the hub). A linear layer
    keeps no per-token KV but two fixed-size states: a convolution state (the last
    `linear_conv_kernel_dim` projected inputs, [1, 2 * key_dim + value_dim, kernel], model dtype)
    and a recurrent state ([1, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim],
    float32: the delta rule accumulates in float32). Prefill hands decode both states of every
    linear layer beside the attention layers' keys and values (`KvCache.conv_states` /
    `recurrent_states`, wire names `layer.{i}.conv` / `layer.{i}.recurrent`), and decode rebuilds
    transformers' own cache (`DynamicCache(config)` makes a `LinearAttentionLayer` for each linear
    layer) with them, so its next step is the one generate() takes.
  * No DeepStack: the tower (Qwen3-VL's, without the DeepStack mergers) returns the visual
    embeddings alone; `prefill_features` refuses DeepStack features.
  * Prompts and pixels are Qwen3-VL's: the same processor class (`Qwen3VLProcessor`, timestamps per
    temporal group), so `preprocess` and `build_prompt` are Qwen3-VL's code, inherited from
    `Qwen3VLProcessorAdapter` (qwen3_vl.py, Qwen3-VL's base too). Positions come from
    `Qwen3_5Model.get_rope_index` (each temporal group placed like an image), [4, 1, L]; decode
    continues every row from its last prompt value + 1 as generate() does.
  * The template's generation prompt opens a thinking block (`<think>\\n`); we render whatever the
    checkpoint's own template renders, so the answer starts where generate()'s does.

Batched decode works (`_HybridBatchKv`): the attention layers use `BatchKv`'s slots, the linear
layers every running row's states stacked along the batch axis. `kv_bytes_per_token` counts the
attention layers' KV only; `linear_state_bytes` is the fixed size per request that the decode KV
budget does not count.

Chunked and batched prefill (`prefill_chunks`: the prefill core's `--prefill-chunk-tokens` and
`--max-prefill-tokens-per-step`) work, each row equal to its whole prompt prefilled alone up to
float rounding:
  * A chunk continues its cache. transformers' Gated DeltaNet (5.x) takes a cache whose linear
    layer already has a state as the left context of a multi-token forward too, not only of a
    one-token step: the conv state's inputs are prepended to the chunk's
    (`LinearAttentionLayer.update_conv_state`) and the recurrent state is the chunked delta rule's
    `initial_state`. The attention layers extend their KV as every family's do, and a chunk's
    positions are its slice of the prompt's [4, 1, L] M-RoPE positions, as Qwen3-VL's.
  * Several prompts from token 0 share one right-padded forward. Causal attention keeps the
    padding out of every valid token's view, but a linear layer would run its states on through
    the padding after the row's last token. `_NeutralPadding` makes every padded position a no-op
    for the states: decay g = 0 (the state is multiplied by exp(0) = 1) and write strength
    beta = 0 (nothing is written), so a row's recurrent state after its padding is exactly its
    state after its last token; and each row's conv state is set to its own last `kernel` inputs.
    Exact in exact arithmetic, and the delta rule's chunk grouping starts at token 0 in every row,
    as alone: only the batched matrix products round differently.

Not supported in this slice (refused, never silently wrong):
  * Token pruning: a recurrent state cannot lose rows, and the prefill drop, KV compression and
    decode eviction are written for attention layers. `text_dims` (the first thing every pruning
    path asks for) raises `UnsupportedByFamily` (a ValueError), which the prefill stage reports
    as INVALID_ARGUMENT naming the family; so do the other pruning methods (their defaults).
    `PruningConfig.kv_dtype` alone (no pruning stage) works: keys, values and conv states are sent
    narrower, recurrent states stay float32 (`KvCache.cast`).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch

from epd.model_runtime.adapter import (
    ChunkResult,
    PrefillChunk,
    PrefillState,
    Prompt,
    TextDims,
    UnsupportedByFamily,
    VisionInputs,
    VisualFeatures,
    VisualMeta,
    VLMAdapter,
)
from epd.model_runtime.batch_kv import BatchKv
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import (
    end_of_sequence,
    fingerprint,
    load_language_model,
    load_vision_part,
)
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.prompt_positions import mrope_prompt_positions
from epd.model_runtime.qwen3_vl import Qwen3VLProcessorAdapter
from epd.model_runtime.thread_hooks import owner_thread_only

log = logging.getLogger(__name__)

PRUNING_REFUSED = (
    "Qwen3.5 (model_type qwen3_5) supports no token pruning yet: its Gated DeltaNet layers keep a "
    "recurrent state that cannot drop tokens, and the prefill drop, KV compression and decode "
    "eviction apply to attention layers only; turn pruning off for this model"
)


class Qwen3_5Adapter(Qwen3VLProcessorAdapter):
    """Loads only the parts a stage needs: "vision" (the tower) and/or "language" (embeddings,
    hybrid decoder layers, lm_head). From safetensors, a one-part stage reads only its own part's
    tensors (never the hub's `mtp.*` multi-token-prediction weights); both parts load transformers'
    whole model."""

    supported_pruning = frozenset()
    pruning_refusal_reason = "its Gated DeltaNet layers keep a recurrent state with no per-token entries to drop; KV compression and decode eviction would cover its attention layers only"

    supports_batched_decode = True  # `_HybridBatchKv`: slots for attention, stacked linear states
    supports_chunked_prefill = True  # chunks continue the linear states; padding leaves them as they are
    num_deepstack_layers = 0
    # Kept at the interface's defaults, not `HfTextAdapter`'s: no embeddings or lm head for the
    # (refused) pruning stages.
    embed = VLMAdapter.embed
    logits = VLMAdapter.logits

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = AutoConfig.from_pretrained(path)
        if self.hf_config.model_type != "qwen3_5":
            raise ValueError(f"Qwen3_5Adapter loads model_type qwen3_5, not {self.hf_config.model_type!r}")
        self.family = "qwen3_5"
        self.processor = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.fingerprint = fingerprint(path)
        vision_config = self.hf_config.vision_config
        self.merge_size = vision_config.spatial_merge_size
        self.temporal_patch_size = vision_config.temporal_patch_size
        text = self.hf_config.text_config
        self.hidden_size = text.hidden_size
        self.layer_types: list[str] = list(text.layer_types)
        self.attention_layers = [i for i, t in enumerate(self.layer_types) if t == "full_attention"]
        self.linear_layers = [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]
        if len(self.attention_layers) + len(self.linear_layers) != len(self.layer_types):
            raise ValueError(f"unknown Qwen3.5 layer types {sorted(set(self.layer_types))}")
        self._load_parts(path, _load_vision_tower, _load_language_model)
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    # -- encoder (preprocess, frame sizes, group times: `Qwen3VLProcessorAdapter`'s) ---------

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([inputs.grid_thw], dtype=torch.long, device=self.device)
        out = self.visual(inputs.pixel_values.to(self.device, self.visual.dtype), grid_thw=grid)
        return out.pooler_output  # [t * h/2 * w/2, hidden]

    # -- prefill (build_prompt: `Qwen3VLProcessorAdapter`'s, with these positions) -----------

    def _prompt_positions(self, input_ids: torch.Tensor, visual: VisualMeta) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

        return mrope_prompt_positions(Qwen3_5Model, self.hf_config, input_ids, visual)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, visual_embeds: torch.Tensor) -> PrefillState:
        state = self._prefill_whole(prompt, visual_embeds)
        self._check_layers(state.cache)  # attention layers' KV + linear layers' conv/recurrent states
        return state

    # -- chunked and batched prefill (module docstring) --------------------------------------

    @torch.inference_mode()
    def prefill_chunks(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """`HfTextAdapter`'s: rows from token 0 share one right-padded forward (`_prefill_padded`),
        a continuing chunk runs alone after its own cache (`_prefill_continue`). DeepStack
        features are refused, as `prefill_features` refuses them."""
        for row in rows:
            if row.deepstack:
                raise ValueError("Qwen3_5Adapter has no DeepStack layers; it takes no DeepStack features")
            num_visual = int(row.prompt.visual_mask.sum())
            if row.visual_embeds.shape[0] != num_visual:
                raise ValueError(
                    f"{row.visual_embeds.shape[0]} visual embeddings for {num_visual} visual positions"
                )
        return super().prefill_chunks(rows)

    def _prefill_padded(self, rows: list[PrefillChunk], neutral_padding: bool = True) -> list[ChunkResult]:
        """Rows from token 0, right-padded to the longest: [B, L]. The attention layers need no
        padding mask (causal; the padding follows every valid token of its row). The linear layers
        would carry their states on through a row's padding; `_NeutralPadding` keeps them as the
        row's last token left them. `neutral_padding=False` only for the tests' negative control."""
        from transformers import DynamicCache

        lm = self._language_model()
        lengths = [row.end for row in rows]
        longest = max(lengths)
        embeds = self._padded_embeds([self._chunk_embeds(row)[0] for row in rows])  # [B, L, H]
        positions = self._padded_mrope_positions(rows)  # [4, B, L]
        cache = DynamicCache(config=self.hf_config.text_config)
        valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [B, L] bool
        neutral = None
        if neutral_padding and not bool(valid.all()):
            kernel = self.hf_config.text_config.linear_conv_kernel_dim
            neutral = _NeutralPadding(lm, self.linear_layers, valid.to(self.device), kernel)
        with neutral if neutral is not None else nullcontext():
            out = lm(
                inputs_embeds=embeds,
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
        if neutral is not None:
            neutral.set_conv_states(cache)
        return self._padded_results(cache, out.last_hidden_state, rows)

    def _split_padded(self, cache, logits: torch.Tensor, lengths: list[int]) -> list[ChunkResult]:
        """Each row its own hybrid cache: attention KV [1, kv_heads, n, head_dim] (padding cut off),
        the row's conv [1, conv_dim, kernel] and recurrent [1, heads, k, v] states; `to_dynamic`
        copies them into a `DynamicCache` that the row's next chunk continues. One row keeps the
        forward's cache."""
        if len(lengths) == 1:
            return [ChunkResult(cache, logits[0])]
        kv = KvCache.from_dynamic(cache)
        results = []
        for i, n in enumerate(lengths):
            row_kv = KvCache(
                [k[i : i + 1, :, :n] for k in kv.keys],
                [v[i : i + 1, :, :n] for v in kv.values],
                kv.attention_layers,
                {j: s[i : i + 1] for j, s in kv.conv_states.items()},
                {j: s[i : i + 1] for j, s in kv.recurrent_states.items()},
            )
            results.append(ChunkResult(row_kv.to_dynamic(self.hf_config.text_config), logits[i]))
        return results

    def chunk_cache_to_kv(self, cache) -> KvCache:
        kv = KvCache.from_dynamic(cache)
        self._check_layers(kv)
        return kv

    @property
    def text_dims(self) -> TextDims:
        """The first thing every pruning stage asks for (`pruned_prefill`, budgets): refused here,
        so a request with any pruning stage gets INVALID_ARGUMENT saying why (PRUNING_REFUSED)."""
        raise UnsupportedByFamily(PRUNING_REFUSED)

    @property
    def language_model(self):
        """The handle the pruning code used before `text_dims`; refused the same way."""
        raise UnsupportedByFamily(PRUNING_REFUSED)

    # -- decode ------------------------------------------------------------------------------

    def new_decode_cache(self, cache: KvCache):
        """transformers' own hybrid cache, as prefill left it: keys/values (and conv states) back in
        the model's dtype (they may arrive narrower, `PruningConfig.kv_dtype`), recurrent states in
        float32 as the delta rule keeps them."""
        self._check_layers(cache)
        dtype = self._language_model().embed_tokens.weight.dtype
        kv = KvCache(
            [k.to(self.device, dtype) for k in cache.keys],
            [v.to(self.device, dtype) for v in cache.values],
            list(cache.layer_ids),
            {i: s.to(self.device, dtype) for i, s in cache.conv_states.items()},
            {i: s.to(self.device, torch.float32) for i, s in cache.recurrent_states.items()},
        )
        return kv.to_dynamic(self.hf_config.text_config)

    # decode_step and decode_batch are `HfTextAdapter`'s: in a batch the attention layers read
    # their slots with each row's padding mask; the linear layers step every row's own states (no
    # mask is needed: one token per row, and a row's conv and delta-rule update never mixes rows).

    def _kv_shape(self) -> tuple[int, int, int, torch.dtype]:
        """Keys and values one token adds: the full-attention layers only (linear layers add none)."""
        c = self.hf_config.text_config
        return len(self.attention_layers), c.num_key_value_heads, c.head_dim, self._model_dtype()

    def new_batch_kv(self) -> BatchKv:
        _, heads, head_dim, dtype = self._kv_shape()
        return _HybridBatchKv(self.layer_types, heads, head_dim, dtype, self.device, self.linear_state_shapes)

    @property
    def decode_state_bytes(self) -> int:
        return self.linear_state_bytes

    @property
    def linear_state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's states of a linear layer, without the batch axis: conv (conv_dim, kernel)
        and recurrent (value heads, key head dim, value head dim)."""
        c = self.hf_config.text_config
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        return (
            (2 * key_dim + value_dim, c.linear_conv_kernel_dim),
            (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
        )

    @property
    def linear_state_bytes(self) -> int:
        """Bytes of every linear layer's conv state (model dtype) and recurrent state (float32):
        the same for every request, whatever its length."""
        dtype = self._language_model().embed_tokens.weight.dtype
        conv, recurrent = (math.prod(shape) for shape in self.linear_state_shapes)
        return len(self.linear_layers) * (conv * dtype.itemsize + recurrent * 4)

    # -- helpers -----------------------------------------------------------------------------

    def prefill_features(self, prompt: Prompt, features: VisualFeatures) -> PrefillState:
        if features.deepstack:
            raise ValueError("Qwen3_5Adapter has no DeepStack layers; it takes no DeepStack features")
        return self.prefill(prompt, features.embeds)

    def _check_layers(self, cache: KvCache) -> None:
        """The cache has KV for exactly the full-attention layers and both states for exactly the
        linear ones: a cache of another model (or one that lost its linear states) is refused."""
        if cache.layer_ids != self.attention_layers:
            raise ValueError(
                f"the cache has KV for layers {cache.layer_ids}; this model's attention layers are "
                f"{self.attention_layers}"
            )
        for name, states in (("conv", cache.conv_states), ("recurrent", cache.recurrent_states)):
            if sorted(states) != self.linear_layers:
                raise ValueError(
                    f"the cache has {name} states for layers {sorted(states)}; this model's linear-attention "
                    f"layers are {self.linear_layers}"
                )


class _HybridBatchKv(BatchKv):
    """The decode batch for a hybrid model. The attention layers keep `BatchKv`'s slots (indexed
    by attention layer: slot j = the j-th full-attention layer). Each linear layer is transformers'
    own `LinearAttentionLayer` holding every running row's states stacked along the batch axis,
    conv [B, conv_dim, kernel] and recurrent [B, heads, k, v] (row r = request r, as in the slots);
    the model's Gated DeltaNet updates them in place at each step. A request joins by appending its
    states, leaves by moving the last row into its place, like the slots. These states are a fixed
    size per request; the KV budget (`kv_bytes_per_token`) does not count them."""

    def __init__(
        self,
        layer_types: list[str],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        state_shapes: tuple[tuple[int, ...], tuple[int, ...]],
    ) -> None:
        """state_shapes: one request's conv and recurrent state of a linear layer, without the batch
        axis (`Qwen3_5Adapter.linear_state_shapes`)."""
        from transformers.cache_utils import Cache, LinearAttentionLayer

        attention = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        super().__init__(len(attention), num_kv_heads, head_dim, dtype, device)
        self.linear_layers = [i for i, t in enumerate(layer_types) if t == "linear_attention"]
        self.state_shapes = state_shapes
        self.linear = {i: LinearAttentionLayer() for i in self.linear_layers}
        slots = iter(self.cache.layers)  # one `_SlotLayer` per attention layer, in layer order
        self.cache = Cache(
            layers=[self.linear[i] if i in self.linear else next(slots) for i in range(len(layer_types))]
        )

    @property
    def num_bytes(self) -> int:
        states = [
            t
            for layer in self.linear.values()
            for t in (layer.conv_states[0], layer.recurrent_states[0])
            if t is not None
        ]
        return super().num_bytes + sum(t.numel() * t.element_size() for t in states)

    def add(self, kv: KvCache, columns: int) -> int:
        """As `BatchKv.add`, and the linear states appended. All or nothing: a cache that does not
        fit (another model's states) is refused before any row changes, since a row in the slots
        without its states (or the reverse) would fail every later step of the batch."""
        missing = [i for i in self.linear_layers if i not in kv.conv_states or i not in kv.recurrent_states]
        if missing or kv.linear_layers != self.linear_layers:
            raise ValueError(
                f"the cache lacks the linear-attention states of layers {missing or kv.linear_layers}"
            )
        conv_shape, recurrent_shape = self.state_shapes
        for i in self.linear_layers:
            got = (tuple(kv.conv_states[i].shape), tuple(kv.recurrent_states[i].shape))
            if got != ((1, *conv_shape), (1, *recurrent_shape)):
                raise ValueError(
                    f"linear layer {i}'s states have shapes {got}; this model's are {(1, *conv_shape)} and "
                    f"{(1, *recurrent_shape)}: prefill and decode serve different models"
                )
        row = self.num_rows  # rows 0..row-1 are the running ones
        states = {}
        for i, layer in self.linear.items():
            conv = kv.conv_states[i].to(self.device, self.dtype)
            recurrent = kv.recurrent_states[i].to(self.device, torch.float32)
            if row > 0:
                running_conv, running_recurrent = layer.conv_states[0], layer.recurrent_states[0]
                if running_conv is None or running_recurrent is None:
                    raise RuntimeError(f"linear layer {i} lost the states of the running rows")
                conv = torch.cat([running_conv[:row], conv])
                recurrent = torch.cat([running_recurrent[:row], recurrent])
            states[i] = conv, recurrent
        super().add(kv, columns)  # raises before its row exists when the KV does not fit
        for i, (conv, recurrent) in states.items():
            _set_linear_states(self.linear[i], conv, recurrent)
        return row

    def remove(self, row: int) -> int | None:
        """As `BatchKv.remove`; the leaving row's linear states are freed at once. Unlike the slots,
        their room is never reused (a join concatenates), and the view [:last] that stood here kept
        the whole old tensors, the leaving row included, until the next join: memory the budget had
        given back (`decode_state_bytes`) and that `num_bytes`, counting the view, did not show."""
        last = self.num_rows - 1
        moved = super().remove(row)
        for layer in self.linear.values():
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            assert conv is not None and recurrent is not None
            if not last:  # an idle decoder holds no state
                _set_linear_states(layer, None, None)
                continue
            if row != last:
                conv[row], recurrent[row] = conv[last], recurrent[last]
            # Copies of the rows that stay, assigned on the layer the model's cache holds.
            layer.conv_states[0], layer.recurrent_states[0] = conv[:last].clone(), recurrent[:last].clone()
        return moved

    def row_cache(self, row: int) -> KvCache:
        kv = super().row_cache(row)
        kv.attention_layers = [i for i in range(len(self.cache.layers)) if i not in self.linear]
        for i, layer in self.linear.items():
            conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
            assert conv is not None and recurrent is not None
            kv.conv_states[i] = conv[row : row + 1].clone()
            kv.recurrent_states[i] = recurrent[row : row + 1].clone()
        return kv


class _NeutralPadding:
    """While open (a `with` block around one right-padded forward), every padded position (`valid`
    [B, L] False) is a no-op for each Gated DeltaNet layer's states, through hooks on the layer's
    own projections:
      * `in_proj_a` -> -inf there: g = -exp(A_log) * softplus(-inf + dt_bias) = 0, so the step
        multiplies the recurrent state by exp(0) = 1 (no decay; a finite a would decay it);
      * `in_proj_b` -> -inf there: beta = sigmoid(-inf) = 0, so the delta rule writes nothing
        (its update is k * beta * (v - S^T k) = 0, and in the chunked form k_beta = v_beta = 0).
    The padding follows each row's last token, so the valid tokens' outputs never see it (causal
    conv and delta rule), and the recurrent state after the padding is exactly the row's.
    The conv state transformers keeps is the last `kernel` inputs of the padded row (padding
    included); `in_proj_qkv`'s output (the conv's inputs, [B, L, conv_dim]) is recorded instead at
    each row's own last `kernel` tokens, and `set_conv_states` writes it over the cache's after the
    forward. A hook that did not run (e.g. a hub kernel replacing the layer's forward) is an error,
    never a silently wrong state."""

    def __init__(self, lm, linear_layers: list[int], valid: torch.Tensor, kernel: int) -> None:
        self.modules = {i: lm.layers[i].linear_attn for i in linear_layers}
        self.valid = valid  # [B, L] bool, on the model's device
        self.kernel = kernel
        self.handles: list[Any] = []
        self.num_neutralised = 0
        self.windows: dict[int, torch.Tensor] = {}  # layer -> [B, conv_dim, kernel]

    def __enter__(self) -> _NeutralPadding:
        for i, module in self.modules.items():
            self.handles += [
                module.in_proj_a.register_forward_hook(owner_thread_only(self._neutral)),
                module.in_proj_b.register_forward_hook(owner_thread_only(self._neutral)),
                module.in_proj_qkv.register_forward_hook(
                    owner_thread_only(lambda _m, _args, out, i=i: self._record(i, out))
                ),
            ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _neutral(self, _module, _args, out: torch.Tensor) -> torch.Tensor:
        self.num_neutralised += 1
        return out.masked_fill(~self.valid[:, :, None], float("-inf"))  # [B, L, heads]

    def _record(self, layer: int, out: torch.Tensor) -> None:
        """The conv state row r would have alone: inputs [n_r - kernel, n_r) as [conv_dim, kernel],
        zeros on the left where n_r < kernel (as `update_conv_state` pads a short prompt)."""
        batch, _, _ = out.shape
        padded = torch.nn.functional.pad(out, (0, 0, self.kernel, 0))  # [B, kernel + L, conv_dim]
        lengths = self.valid.sum(dim=1)  # [B]
        index = lengths[:, None] + torch.arange(self.kernel, device=out.device)[None, :]  # [B, kernel]
        rows = torch.arange(batch, device=out.device)[:, None]
        self.windows[layer] = padded[rows, index].transpose(1, 2)  # [B, conv_dim, kernel]

    def set_conv_states(self, cache) -> None:
        if self.num_neutralised != 2 * len(self.modules) or self.windows.keys() != self.modules.keys():
            raise RuntimeError(
                "the Gated DeltaNet layers did not run their projections as modules (a hub kernel?): "
                "the padding of a batched prefill would reach their states"
            )
        for i, window in self.windows.items():
            state = cache.layers[i].conv_states[0]  # [B, conv_dim, kernel]
            if state is None or state.shape != window.shape:
                raise RuntimeError(f"linear layer {i} kept no conv state of shape {tuple(window.shape)}")
            state.copy_(window)


def _set_linear_states(layer, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> None:
    """A `LinearAttentionLayer` (state 0) as a prefill leaves it: states present, `has_previous_state`
    set (so the next token takes the single-step conv and recurrent path); None empties it."""
    present = conv is not None
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = present
    layer.has_previous_state[0] = present
    layer.conv_kernel_size[0] = int(conv.shape[-1]) if conv is not None else None
    if conv is not None:
        layer.dtype, layer.device = conv.dtype, conv.device


def _load_vision_tower(path: str, hf_config, dtype: torch.dtype):
    """The tower (patch embedding, blocks, merger) alone, only its tensors read."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return load_vision_part(
        path, hf_config, dtype, lambda: Qwen3_5VisionModel._from_config(hf_config.vision_config, dtype=dtype)
    )


def _load_language_model(path: str, hf_config, dtype: torch.dtype):
    """The hybrid text model and lm_head alone, at the whole model's attribute paths; the tower's
    tensors (and the hub's `mtp.*`) are never read."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    return load_language_model(path, hf_config, dtype, Qwen3_5TextModel)
