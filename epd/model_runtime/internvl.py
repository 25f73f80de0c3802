"""InternVL (InternVL3 / InternVL3.5 "-hf" checkpoints) behind `VLMAdapter`, on transformers' own
`InternVLForConditionalGeneration`.

An InternViT tower (one square tile or frame at a time, a CLS token dropped, absolute position
embeddings of a fixed grid), a pixel-shuffle projector (each 2 x 2 block of patches -> one token:
32 x 32 patches at 448 px -> 256 tokens, `image_seq_length`), and a Qwen3 (InternVL3.5), Qwen2
(InternVL3) or Llama language model with plain 1-D rotary positions. Reproduced exactly as
transformers 5.x computes it (the encoder calls the model's own `get_image_features`):

  * Video: every frame is resized to the tile size (no tiling) and encoded alone; the processor
    expands the template's `<video>` into one group per frame,
    `Frame{i}: <img><IMG_CONTEXT> * image_seq_length</img>`, joined by newlines. Frames are
    epd's own: the processor is called with `do_sample_frames=False`, as vLLM does with frames it
    was given, so its own (middle-of-segment) sampling never runs.
  * Image: "dynamic resolution": the best grid of 1..max_patches tiles for the image's aspect
    ratio (`crop_to_patches`, on by default in InternVLProcessor), plus a thumbnail when there is
    more than one tile; the template's `<IMG_CONTEXT>` becomes
    `<img><IMG_CONTEXT> * (tiles * image_seq_length)</img>`.

Every visual placeholder is `<IMG_CONTEXT>` and every token belongs to one tile or frame, which
the tower encodes independently: the encoder's frame groups concatenate to the whole video's
embeddings, and "visual token i" is token i % image_seq_length of frame i // image_seq_length.

`grid_thw` (what `VisualMeta` carries; `num_visual_tokens` reads it): (frames or tiles, patches
per side, patches per side), e.g. (32, 32, 32) for 32 frames at 448 px, (7, 32, 32) for an image
of 6 tiles and its thumbnail. Positions: 1-D (`OneDimTextAdapter`). No sparse encoding (the
position embeddings are per patch of a fixed grid) and no pruning stage.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from epd.model_runtime.adapter import Prompt, RenderOptions, VisionInputs, VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import (
    end_of_sequence,
    fingerprint,
    load_full_model,
    load_nested_language_model,
    load_vision_part,
    nested_language_key,
    safetensors_files,
)
from epd.model_runtime.llava_onevision import resize_frame_to_size
from epd.model_runtime.one_dim_text import OneDimTextAdapter
from epd.model_runtime.prompt_positions import one_dim_positions
from epd.model_runtime.template_errors import check_media_placeholders
from epd.model_runtime.visual_placeholders import checked_visual_mask
from epd.video.types import DecodedVideo, FrameResize

log = logging.getLogger(__name__)


class InternVLAdapter(OneDimTextAdapter):
    """Loads only the parts a stage needs: "vision" (InternViT tower and projector) and/or
    "language" (the text model's embeddings, decoder layers, lm_head). From safetensors, a
    one-part stage reads only its own part's tensors; both parts load transformers' whole model."""

    supported_pruning = frozenset()
    pruning_refusal_reason = "the encoder stages assume Qwen's patch rows and 2x2 merge, and the layer-by-layer prefill is not written for it yet"

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = AutoConfig.from_pretrained(path)
        if self.hf_config.model_type != "internvl":
            raise ValueError(f"InternVLAdapter loads model_type internvl, not {self.hf_config.model_type!r}")
        self.family = "internvl"
        self.processor = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.fingerprint = fingerprint(path)
        vc = self.hf_config.vision_config
        self.patches_per_side = vc.image_size[0] // vc.patch_size[0]  # 32 at 448 px / 14
        self.tokens_per_tile = int(self.patches_per_side * self.hf_config.downsample_ratio) ** 2  # 256
        if self.processor.image_seq_length != self.tokens_per_tile:
            raise ValueError(
                f"the processor writes {self.processor.image_seq_length} placeholders per tile but the "
                f"model makes {self.tokens_per_tile} tokens of one; the checkpoint's processor and "
                "config disagree"
            )
        self.hidden_size = self.hf_config.text_config.hidden_size
        self.image_token_id = self.hf_config.image_token_id
        # What the processor's own __call__ gives its image processor (InternVLProcessor's default
        # `crop_to_patches=True` over the image processor's own setting).
        merged = self.processor._merge_kwargs(tokenizer_init_kwargs=self.tokenizer.init_kwargs)
        self._images_kwargs = {k: v for k, v in merged["images_kwargs"].items() if k != "return_tensors"}
        self.visual: Any = None  # has get_image_features (InternVLModel's)
        self.model: Any = None  # .model.language_model, .lm_head
        if self.parts >= {"vision", "language"}:
            self.model = load_full_model(path, self.dtype, self.device)
            self.visual = self.model.model
        elif "vision" in self.parts:
            self.visual = _load_vision_part(path, self.hf_config, self.dtype).to(self.device)
        elif "language" in self.parts:
            self.model = _load_language_part(path, self.hf_config, self.dtype).to(self.device).eval()
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    # -- encoder -----------------------------------------------------------------------------

    def frame_resizer(self, clip_num_frames: int) -> FrameResize | None:
        """The video processor's own resize, one frame at a time, where it resizes every frame to
        one fixed size (`size` = height and width: 448 x 448 on the hub), whatever the clip's length."""
        from transformers import InternVLVideoProcessor

        vp = self.processor.video_processor
        size: Any = vp.size
        if type(vp) is not InternVLVideoProcessor or not (vp.do_resize and size.height and size.width):
            return None  # sized some other way: keep frames as decoded
        return partial(resize_frame_to_size, vp)

    def preprocess(self, video: DecodedVideo, clip_num_frames: int | None = None) -> VisionInputs:
        """`clip_num_frames` is not needed: every frame is resized to the same square and encoded alone."""
        side = self.patches_per_side
        if video.is_image:
            out = self.processor.image_processor(
                images=[video.frames[0]], **self._images_kwargs, return_tensors="pt"
            )
            tiles = out["pixel_values"]  # [tiles, C, H, W]: the grid's tiles, then the thumbnail
            return VisionInputs("image", tiles, (int(tiles.shape[0]), side, side), 0.0)
        out = self.processor.video_processor(
            videos=[video.frames], do_sample_frames=False, return_tensors="pt"
        )
        pixels = out["pixel_values_videos"][0]  # [T, C, H, W]
        return VisionInputs("video", pixels, (int(pixels.shape[0]), side, side), 1.0 / video.sampled_fps)

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        return self.encode_batch([inputs])[0]

    @torch.inference_mode()
    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """Every tile and frame of every input through one `get_image_features` call (the tower
        and the pixel shuffle work on each alone), split back per input."""
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        pixels = torch.cat([x.pixel_values for x in inputs]).to(self.device)
        feats = self.visual.get_image_features(pixels).pooler_output  # [tiles, tokens, hidden]
        counts = [self.num_visual_tokens(x.grid_thw) for x in inputs]
        return list(feats.flatten(0, 1).split(counts))

    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """`image_seq_length` tokens per frame or tile."""
        return grid_thw[0] * self.tokens_per_tile

    # -- prefill -----------------------------------------------------------------------------

    def build_prompt(
        self,
        conversation: list[dict[str, Any]],
        visual: VisualMeta | None,
        options: RenderOptions = RenderOptions(),
    ) -> Prompt:
        if visual is None:
            return self._text_only_prompt(conversation, options)
        proc = self.processor
        text = self._render(conversation, options)
        pad = proc.video_token if visual.modality == "video" else proc.image_token
        check_media_placeholders(text, proc, visual.modality, options)
        # Expanded by the processor's own code, as its __call__ does (only the counts are read).
        count = visual.grid_thw[0]
        if visual.modality == "video":
            expanded = proc.replace_video_token({"pixel_values_videos": [torch.empty(count, 0)]}, video_idx=0)
        else:
            expanded = proc.replace_image_token({"num_patches": [count]}, image_idx=0)
        text = text.replace(pad, expanded, 1)
        input_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        options.between_steps()  # expanded and tokenised; the positions next
        visual_mask = checked_visual_mask(
            input_ids[0] == self.image_token_id, self.num_visual_tokens(visual.grid_thw), proc.image_token
        )
        return Prompt(input_ids, one_dim_positions(input_ids.shape[1]), visual_mask)

    # prefill, chunked and batched prefill, decode: `OneDimTextAdapter`'s.
    # Pruning: layerwise_prefill, capture_queries and the decode-cache eviction hooks keep the
    # defaults: the prefill drop, KV compression and decode eviction are refused (UnsupportedByFamily).


# -- stage loading ----------------------------------------------------------------------------
# Checkpoint keys: `save_pretrained` in transformers 5 writes the hub's layout ("vision_tower.*",
# "multi_modal_projector.*", "language_model.model.*", "language_model.lm_head.*"); a whole
# model's module names are "model.vision_tower.*", "model.multi_modal_projector.*",
# "model.language_model.*", "lm_head.*". Both are read.


def vision_key(key: str) -> str | None:
    """A checkpoint key -> its name in `_VisionPart` (tower, projector), else None."""
    rest = key[len("model.") :] if key.startswith("model.") else key
    return rest if rest.startswith(("vision_tower.", "multi_modal_projector.")) else None


language_key = nested_language_key  # the text model and lm_head; nothing else on the language side


def _vision_part_class():
    from transformers.models.internvl.modeling_internvl import InternVLModel, InternVLMultiModalProjector

    class _VisionPart(torch.nn.Module):
        """The encoder's part of `InternVLModel` at its attribute names, with its own
        `get_image_features` (which reads only these, `config` and `dtype`)."""

        def __init__(self, config, dtype: torch.dtype) -> None:
            from transformers import AutoModel

            super().__init__()
            self.config = config
            # dtype given as from_pretrained gives it to every sub-config
            self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
            self.multi_modal_projector = InternVLMultiModalProjector(config)

        @property
        def dtype(self) -> torch.dtype:  # get_image_features casts the pixels to it, as the whole model's
            return self.vision_tower.dtype

        get_image_features = InternVLModel.get_image_features
        pixel_shuffle = InternVLModel.pixel_shuffle

    return _VisionPart


def _load_vision_part(path: str, hf_config, dtype: torch.dtype):
    return load_vision_part(
        path,
        hf_config,
        dtype,
        lambda: _vision_part_class()(hf_config, dtype),
        rename=vision_key,
        full_part=lambda model: model.model,
        what="vision part",
    )


def _load_language_part(path: str, hf_config, dtype: torch.dtype):
    """`LanguageOnly` with the text model (whatever its type: AutoModel, as InternVLModel builds
    it) and lm_head; without safetensors the full model, its tower dropped."""
    root, files = safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its language model", root)
        model = load_full_model(str(root), dtype, torch.device("cpu"))
        model.model.vision_tower = model.model.multi_modal_projector = None
        return model
    return load_nested_language_model(root, files, path, hf_config, dtype, language_key)[0]
