"""Qwen2-VL and Qwen2.5-VL behind `VLMAdapter`, on transformers' own classes.

Positions are where a split pipeline most easily drifts from `generate()`; we reproduce what
transformers 5.x does for these classes:
  * prefill position ids are [4, 1, L]: row 0 is the plain text position (transformers uses it to
    build the causal mask), rows 1-3 are `get_rope_index`'s M-RoPE rows (temporal, height, width);
  * each decode step continues every row from its own last prompt value + 1 (generate's
    `_update_model_kwargs_for_generation`), not from `rope_deltas`;
  * positions are always passed explicitly, because the model keeps `rope_deltas` on the module
    between calls and would otherwise mix requests.
Qwen2.5-VL also needs `second_per_grid_ts` (seconds per temporal patch group) for its temporal row.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch

from epd.model_runtime.adapter import (
    Prompt,
    RenderOptions,
    VisionInputs,
    VisualMeta,
)
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import end_of_sequence, fingerprint, load_vision_part
from epd.model_runtime.hf_loading import load_language_model as _load_text_part
from epd.model_runtime.qwen_text import QwenTextAdapter
from epd.model_runtime.template_errors import check_media_placeholders
from epd.model_runtime.visual_placeholders import checked_visual_mask, placeholder_id
from epd.video.types import DecodedVideo, FrameResize

log = logging.getLogger(__name__)


class Qwen2VLAdapter(QwenTextAdapter):
    """Loads only the parts a stage needs: "vision" (the vision tower) and/or "language"
    (embeddings, decoder layers, lm_head). From safetensors, a one-part stage reads only its own
    part's tensors (the encoder never the language model's, prefill and decode never the tower's);
    both parts (the embedded mode, training) load transformers' whole model."""

    supported_pruning = frozenset(
        {"temporal_drop", "spatial_merge", "key_tokens", "prefill_drop", "kv_compress", "decode_evict"}
    )
    pruning_refusal_reason = ""

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.processor = AutoProcessor.from_pretrained(path)
        self.fingerprint = fingerprint(path)
        self.tokenizer = self.processor.tokenizer
        self.hf_config = AutoConfig.from_pretrained(path)
        self.family = self.hf_config.model_type  # "qwen2_vl" or "qwen2_5_vl"
        # Qwen2.5-VL's windowed attention reorders patches by window: no subset encoding there.
        self.supports_sparse_vision = self.family == "qwen2_vl"
        self.merge_size = self.hf_config.vision_config.spatial_merge_size
        self.hidden_size = self.hf_config.text_config.hidden_size
        self._load_parts(path, _load_vision_tower, _load_language_model)
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    # -- encoder -----------------------------------------------------------------------------

    def frame_resizer(self, clip_num_frames: int) -> FrameResize | None:
        """The video processor's own resize, one frame at a time (`resize_frame_once`): its target
        size depends on the frame's size alone (`cap_pixels_per_frame=False`, as `preprocess`
        calls it), so it is the same for one frame as for a whole video of any length."""
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        vp = self.processor.video_processor
        size: Any = vp.size  # a SizeDict once the processor is built (the class attribute is a dict)
        if type(vp) is not Qwen2VLVideoProcessor or not (
            vp.do_resize and size.shortest_edge and size.longest_edge
        ):
            return None  # another processor (a checkpoint's own subclass): keep frames as decoded
        return partial(resize_frame_once, vp)

    def preprocess(self, video: DecodedVideo, clip_num_frames: int | None = None) -> VisionInputs:
        """`clip_num_frames` is not needed: Qwen2-VL's processor (per-frame cap off) resizes frame
        by frame, and patchify pads a 1-frame tail group as it pads the whole clip's tail."""
        if video.is_image:
            out = self.processor.image_processor(images=[video.frames[0]], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return VisionInputs("image", out["pixel_values"], grid, 0.0)  # type: ignore[arg-type]
        vp = self.processor.video_processor
        out = vp(
            videos=[video.frames],
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            return_tensors="pt",
        )
        grid = tuple(int(x) for x in out["video_grid_thw"][0])
        second_per_grid_t = vp.temporal_patch_size / video.sampled_fps
        return VisionInputs("video", out["pixel_values_videos"], grid, second_per_grid_t)  # type: ignore[arg-type]

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([inputs.grid_thw], dtype=torch.long, device=self.device)
        pixels = inputs.pixel_values.to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid)
        return out.pooler_output  # [t * h/2 * w/2, hidden]

    @torch.inference_mode()
    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """One tower call: patches concatenated [sum patches, patch_dim], one grid row each
        ([N, 3]); the tower builds per-image (per temporal group) attention boundaries from the
        rows, so nothing attends across inputs. Images and videos mix (an image is one temporal
        patch). Output [sum tokens, hidden] split back in input order."""
        if len(inputs) == 1:
            return [self.encode(inputs[0])]
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([i.grid_thw for i in inputs], dtype=torch.long, device=self.device)
        pixels = torch.cat([i.pixel_values for i in inputs]).to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid).pooler_output
        return list(out.split([self.num_visual_tokens(i.grid_thw) for i in inputs]))

    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    # -- prefill -----------------------------------------------------------------------------

    def build_prompt(
        self,
        conversation: list[dict[str, Any]],
        visual: VisualMeta | None,
        options: RenderOptions = RenderOptions(),
    ) -> Prompt:
        if visual is None:
            return self._text_only_prompt(conversation, options)
        # The processor's own template renders the parts in order (no separator between text parts,
        # earlier turns as it renders them); we only expand the one placeholder, as its __call__ does.
        text = self._render(conversation, options)
        pad = self.processor.video_token if visual.modality == "video" else self.processor.image_token
        num_tokens = self.num_visual_tokens(visual.grid_thw)  # every placeholder, before any dropping
        check_media_placeholders(text, self.processor, visual.modality, options)
        text = text.replace(pad, pad * num_tokens, 1)
        input_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        options.between_steps()  # expanded and tokenised; the positions next
        pad_id = placeholder_id(self.hf_config, visual.modality)
        visual_mask = checked_visual_mask(input_ids[0] == pad_id, num_tokens, pad)
        return Prompt(input_ids, self._prompt_positions(input_ids, visual), visual_mask)

    def _prompt_positions(self, input_ids: torch.Tensor, visual: VisualMeta) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""
        mm_type = 2 if visual.modality == "video" else 1
        mm_token_type_ids = (input_ids == placeholder_id(self.hf_config, visual.modality)).long() * mm_type
        grid = torch.tensor([visual.grid_thw], dtype=torch.long)
        kwargs = {"image_grid_thw": grid} if mm_type == 1 else {"video_grid_thw": grid}
        if self.family == "qwen2_5_vl" and mm_type == 2:
            kwargs["second_per_grid_ts"] = torch.tensor([visual.second_per_grid_t])
        rope_index = _rope_index_fn(self.hf_config)
        mrope, _ = rope_index(self.hf_config, input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs)
        text_row = torch.arange(input_ids.shape[1], dtype=torch.long)[None, None]
        return torch.cat([text_row, mrope], dim=0)

    @torch.inference_mode()
    def encode_sparse(
        self,
        pixel_values: torch.Tensor,
        grid_thw: tuple[int, int, int],
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> torch.Tensor:
        """The tower on kept patches only: position_ids [P', 2] (row, col), cu_seqlens per group."""
        if self.visual is None or not self.supports_sparse_vision:
            raise RuntimeError("sparse vision encoding needs Qwen2-VL's vision tower")
        grid = torch.tensor([grid_thw], dtype=torch.long, device=self.device)
        out = self.visual(
            pixel_values.to(self.device, self.visual.dtype),
            grid_thw=grid,
            position_ids=position_ids.to(self.device),
            cu_seqlens=cu_seqlens.to(self.device),
        )
        return out.pooler_output

    supports_chunked_prefill = True  # `HfTextAdapter.prefill_chunks` and its M-RoPE padded forward


def _rope_index_fn(hf_config):
    """The family's unbound `get_rope_index`; it reads only `self.config`, so we call it on a
    tiny stand-in instead of needing the whole model (the encoder-free stages still have it)."""
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as cls
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as cls

    class _Holder:
        def __init__(self, config):
            self.config = config

        get_vision_position_ids = cls.get_vision_position_ids

    def call(config, input_ids, **kwargs):
        return cls.get_rope_index(_Holder(config), input_ids, **kwargs)

    return call


def _load_vision_tower(path: str, hf_config, dtype: torch.dtype):
    """The vision tower alone, only its weights read ("visual.*" or "model.visual.*")."""
    tower_cls = _vision_tower_class(hf_config)
    return load_vision_part(
        path, hf_config, dtype, lambda: tower_cls._from_config(hf_config.vision_config, dtype=dtype)
    )


def _load_language_model(path: str, hf_config, dtype: torch.dtype):
    """The text model and lm_head alone; the tower's tensors are never read."""
    return _load_text_part(path, hf_config, dtype, _text_model_class(hf_config))


def _text_model_class(hf_config):
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel as text
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel as text
    return text


def _vision_tower_class(hf_config):
    if hf_config.model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as tower,
        )
    else:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as tower,
        )
    return tower


def resize_frame_once(vp, rgb: np.ndarray) -> np.ndarray:
    """One decoded frame [H, W, 3] uint8 resized by Qwen2-VL's video processor `vp` as its
    `preprocess` would resize it ([h, w, 3], h and w from its `smart_resize`), or `rgb` itself
    where that would not give the same pixels.

    Same pixels: the processor turns frames into [1, T, 3, H, W] uint8 and resizes them with
    torchvision (bicubic, antialias), each frame's planes on their own, so one frame alone comes
    out as it does among others; given the resized frame, `smart_resize` returns its size again
    and torchvision returns a tensor of the target size unchanged, so `preprocess`'s resize is
    then a no-op. Where `smart_resize` of the target is not the target (bounds too close for its
    rounding) or it refuses the frame (aspect ratio over 200: `preprocess` raises its own error),
    the frame is left for `preprocess` to resize.
    """
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

    height, width = rgb.shape[:2]
    size: Any = vp.size  # SizeDict
    factor = vp.patch_size * vp.merge_size
    bounds = {"factor": factor, "min_pixels": size.shortest_edge, "max_pixels": size.longest_edge}
    try:
        target = smart_resize(height, width, **bounds)
    except ValueError:
        return rgb
    if target == (height, width) or smart_resize(*target, **bounds) != target:
        return rgb
    # [1, 1, 3, H, W], as vp lays it out
    video = torch.from_numpy(rgb[None]).permute(0, 3, 1, 2).contiguous()[None]
    resized = vp.resize(
        video,
        size=size,
        resample=vp.resample,
        factor=factor,
        temporal_factor=vp.temporal_patch_size,
        cap_pixels_per_frame=False,
    )  # [1, 1, 3, h, w]
    return resized[0, 0].permute(1, 2, 0).contiguous().numpy()  # [h, w, 3]
