"""LLaVA-OneVision behind `VLMAdapter`, on transformers' own `LlavaOnevisionForConditionalGeneration`.

The first family here that is not Qwen-shaped: a SigLIP tower (one square image per frame or
crop, no temporal patches, no merger), a two-layer projector, a Qwen2 language model with plain
1-D rotary positions, and a learned `image_newline` vector. Reproduced exactly as transformers
5.x computes it (the encoder calls the model's own `get_video_features` / `get_image_features`):

  * Video: every frame -> tower -> projector -> 2x2 bilinear pooling (ceil(p/2)^2 tokens per
    frame of p x p patches: 27 x 27 -> 14 x 14 = 196 at 384 px), all frames' tokens in order,
    then ONE `image_newline` after the last frame. The processor expands `<video>` into
    T * ceil(p/2)^2 + 1 placeholders.
  * Image: "anyres": a base crop plus the tiles of the best `image_grid_pinpoints` resolution,
    unpadded to the image's aspect ratio, reduced to at most `anyres_max_9` tiles, one
    `image_newline` after every row of tile features (`pack_image_features`).

What crosses Encode -> Prefill:
  * video: the T * ceil(p/2)^2 pooled frame tokens, NOT the trailing newline. The newline is a
    learned constant, not a function of the frames, so prefill (which also loads the 1 x hidden
    `image_newline`) writes it into the video's last placeholder itself. This keeps every frame
    group's embeddings independent of the others (the encoder encodes `frames_per_group` frames
    at a time and concatenates, which would otherwise put one newline after every group), and
    keeps "visual token i" = a frame token for token dropping. `Prompt.visual_mask` marks the
    frame tokens only; the newline placeholder is the `<video>` token outside the mask.
  * image: the whole packed sequence (base crop, tiles, row newlines): an image is encoded in one
    call, and its newlines sit between rows, so they travel with it.

`grid_thw` (what `VisualMeta` carries; `num_visual_tokens` reads it):
  * video: (frames, patches per frame side, patches per frame side), e.g. (64, 27, 27);
  * image: (1, image height, image width) in PIXELS of the original image: the anyres token count
    and unpadding follow from the original size, which prefill must know to expand `<image>`.

Positions: 1-D (`OneDimTextAdapter`: all four interface rows hold the same position, row 0 is read).
No sparse (subset-of-patches) encoding: SigLIP's position embeddings are per patch of a fixed grid.
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any

import numpy as np
import torch

from epd.model_runtime.adapter import (
    PrefillChunk,
    Prompt,
    RenderOptions,
    VisionInputs,
    VisualMeta,
)
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
from epd.model_runtime.one_dim_text import OneDimTextAdapter
from epd.model_runtime.prompt_positions import one_dim_positions
from epd.model_runtime.template_errors import check_media_placeholders
from epd.model_runtime.visual_placeholders import checked_visual_mask
from epd.video.types import DecodedVideo, FrameResize, MediaError

log = logging.getLogger(__name__)

NEWLINE_KEY = "image_newline"


class LlavaOnevisionAdapter(OneDimTextAdapter):
    """Loads only the parts a stage needs: "vision" (SigLIP tower, projector, image_newline) and/or
    "language" (Qwen2 embeddings, decoder layers, lm_head, and the 1 x hidden image_newline that
    closes a video). From safetensors, a one-part stage reads only its own part's tensors; both
    parts load transformers' whole model."""

    supported_pruning = frozenset()
    pruning_refusal_reason = "the encoder stages assume Qwen's patch rows and 2x2 merge, and the layer-by-layer prefill is not written for it yet"

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = AutoConfig.from_pretrained(path)
        if self.hf_config.model_type != "llava_onevision":
            raise ValueError(
                f"LlavaOnevisionAdapter loads model_type llava_onevision, not {self.hf_config.model_type!r}"
            )
        self.family = "llava_onevision"
        self.processor = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.fingerprint = fingerprint(path)
        vc = self.hf_config.vision_config
        self.patches_per_side = vc.image_size // vc.patch_size  # 27 at 384 px / 14
        self.pooled_per_side = math.ceil(self.patches_per_side / 2)  # 14
        self.hidden_size = self.hf_config.text_config.hidden_size
        self.video_token_id = self.hf_config.video_token_id
        self.image_token_id = self.hf_config.image_token_id
        self.visual: Any = None  # has get_video_features / get_image_features (LlavaOnevisionModel's)
        self.model: Any = None  # .model.language_model, .lm_head
        self.image_newline: torch.Tensor | None = None  # [hidden], for the language side
        if self.parts >= {"vision", "language"}:
            self.model = load_full_model(path, self.dtype, self.device)
            self.visual = self.model.model
            self.image_newline = self.model.model.image_newline.data
        elif "vision" in self.parts:
            self.visual = _load_vision_part(path, self.hf_config, self.dtype).to(self.device)
        elif "language" in self.parts:
            self.model, newline = _load_language_part(path, self.hf_config, self.dtype)
            self.model = self.model.to(self.device).eval()
            self.image_newline = newline.to(self.device)
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    # -- encoder -----------------------------------------------------------------------------

    def frame_resizer(self, clip_num_frames: int) -> FrameResize | None:
        """The video processor's own resize, one frame at a time (`resize_frame_to_size`), where it
        resizes every frame to one fixed size (`size` = height and width: 384x384 on the hub),
        whatever the clip's length."""
        from transformers import LlavaOnevisionVideoProcessor

        vp = self.processor.video_processor
        size: Any = vp.size  # a SizeDict once the processor is built
        if type(vp) is not LlavaOnevisionVideoProcessor or not (vp.do_resize and size.height and size.width):
            return None  # sized from each frame (shortest_edge): its own rounding, keep frames as decoded
        return partial(resize_frame_to_size, vp)

    def preprocess(self, video: DecodedVideo, clip_num_frames: int | None = None) -> VisionInputs:
        """`clip_num_frames` is not needed: every video frame is resized to the same fixed square
        and pooled alone, whatever the clip's length."""
        if video.is_image:
            frame = video.frames[0]
            out = self.processor.image_processor(images=[frame], return_tensors="pt")
            height, width = (int(x) for x in out["image_sizes"][0])
            if height == width == self.patches_per_side:  # would read as a one-frame video grid
                raise MediaError(f"an image of {height} x {width} pixels is too small for this model")
            # [crops, C, H, W]: the base crop and the anyres tiles (the batch dimension dropped)
            return VisionInputs("image", out["pixel_values"][0], (1, height, width), 0.0)
        out = self.processor.video_processor(
            videos=[video.frames], do_sample_frames=False, return_tensors="pt"
        )
        pixels = out["pixel_values_videos"][0]  # [T, C, H, W]
        side = self.patches_per_side
        return VisionInputs("video", pixels, (int(pixels.shape[0]), side, side), 1.0 / video.sampled_fps)

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        return self.encode_batch([inputs])[0]

    @torch.inference_mode()
    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """Videos: all their frames through one tower call (SigLIP attends within a frame, pooling
        is per frame), split back per input. Images: one `get_image_features` call for all."""
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        out: list[torch.Tensor | None] = [None] * len(inputs)
        dtype = self.visual.vision_tower.dtype
        videos = [i for i, x in enumerate(inputs) if x.modality == "video"]
        images = [i for i, x in enumerate(inputs) if x.modality != "video"]
        if videos:
            frames = torch.cat([inputs[i].pixel_values for i in videos]).to(self.device, dtype)
            feats = self.visual.get_video_features(frames[None]).pooler_output[0, :-1]  # newline dropped
            counts = [self.num_visual_tokens(inputs[i].grid_thw) for i in videos]
            for i, f in zip(videos, feats.split(counts), strict=True):
                out[i] = f
        if images:
            pixels = torch.cat([inputs[i].pixel_values for i in images]).to(self.device, dtype)
            sizes = torch.tensor([inputs[i].grid_thw[1:] for i in images], dtype=torch.long)
            packed = self.visual.get_image_features(pixels, sizes).pooler_output
            for i, f in zip(images, packed, strict=True):
                out[i] = f
        return [f for f in out if f is not None]

    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Tokens that cross Encode -> Prefill: video T * ceil(p/2)^2 (the closing newline is
        prefill's); image: the processor's anyres count for an image of grid_thw[1:] pixels."""
        t, h, w = grid_thw
        if h == w == self.patches_per_side:
            return t * self.pooled_per_side**2
        return self._num_image_tokens(h, w)

    def _num_image_tokens(self, height: int, width: int) -> int:
        proc = self.processor
        size = proc.image_processor.size
        n = proc._get_number_of_features(height, width, size["height"], size["width"])
        return n - 1 if proc.vision_feature_select_strategy == "default" else n

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
        # Expanded by the processor's own code, as its __call__ does.
        t, h, w = visual.grid_thw
        if visual.modality == "video":
            expanded = proc.replace_video_token({"pixel_values_videos": [[None] * t]}, video_idx=0)
        else:
            side = proc.image_processor.size["height"]
            expanded = proc.replace_image_token(
                {
                    "batch_num_images": [1],
                    "image_sizes": [[h, w]],
                    "pixel_values": [[torch.empty(0, side, side)]],  # only its shape is read
                },
                image_idx=0,
            )
        text = text.replace(pad, expanded, 1)
        input_ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        options.between_steps()  # expanded and tokenised; the positions next
        # Read by the config's ids (the model's, what `_embed` reads too): a tokenizer without the
        # placeholder has no id for it, and `checked_visual_mask` says so.
        video = visual.modality == "video"
        placeholders = input_ids[0] == (self.video_token_id if video else self.image_token_id)
        # A video's expansion writes one more: its last placeholder is the newline prefill writes.
        checked_visual_mask(placeholders, self.num_visual_tokens(visual.grid_thw) + int(video), pad)
        visual_mask = placeholders.clone()
        if video:
            visual_mask[int(placeholders.nonzero()[-1])] = False
        return Prompt(input_ids, one_dim_positions(input_ids.shape[1]), visual_mask)

    def _embed(
        self, input_ids: torch.Tensor, visual_mask: torch.Tensor, visual: torch.Tensor
    ) -> torch.Tensor:
        """[1, n, hidden]: token embeddings of `input_ids` [1, n], the visual positions filled with
        `visual` (in order), a video's closing placeholder with `image_newline`."""
        lm = self._language_model()
        embeds = lm.embed_tokens(input_ids.to(self.device))
        mask = visual_mask.to(self.device)
        if int(mask.sum()):
            embeds[0, mask] = visual.to(self.device, embeds.dtype)
        closing = (input_ids[0].to(self.device) == self.video_token_id) & ~mask
        if bool(closing.any()):
            assert self.image_newline is not None
            embeds[0, closing] = self.image_newline.to(embeds.dtype)
        return embeds

    # prefill: `HfTextAdapter`'s (`_prefill_whole` on the 1-D row), over these embeddings

    def _prompt_embeds(self, prompt: Prompt, visual_embeds: torch.Tensor) -> torch.Tensor:
        return self._embed(prompt.input_ids, prompt.visual_mask, visual_embeds)

    def _chunk_embeds(self, row: PrefillChunk) -> torch.Tensor:
        first = int(row.prompt.visual_mask[: row.start].sum())  # visual tokens of earlier chunks
        mask = row.prompt.visual_mask[row.start : row.end]
        return self._embed(
            row.prompt.input_ids[:, row.start : row.end],
            mask,
            row.visual_embeds[first : first + int(mask.sum())],
        )

    # -- decode: `OneDimTextAdapter`'s (`HfTextAdapter`'s on the 1-D position) --------------------
    # Pruning: layerwise_prefill, capture_queries and the decode-cache eviction hooks keep the
    # defaults: the prefill drop, KV compression and decode eviction are refused (UnsupportedByFamily).


# -- stage loading ----------------------------------------------------------------------------
# Checkpoint keys: `save_pretrained` in transformers 5 writes the hub's layout back ("vision_tower.*",
# "multi_modal_projector.*", "image_newline", "language_model.model.*", "language_model.lm_head.*");
# the llava-hf hub checkpoints nest SigLIP once more ("vision_tower.vision_model.*"); the module
# names are "model.vision_tower.*", "model.language_model.*", "lm_head.*". All are read.


def vision_key(key: str) -> str | None:
    """A checkpoint key -> its name in `_VisionPart` (tower, projector, image_newline), else None."""
    for prefix in ("model.", ""):
        rest = key[len(prefix) :] if key.startswith(prefix) else None
        if rest is not None and rest.startswith("vision_tower.vision_model."):  # the hub's SigLIP nesting
            return "vision_tower." + rest[len("vision_tower.vision_model.") :]
        if rest is not None and rest.startswith(("vision_tower.", "multi_modal_projector.")):
            return rest
        if rest == NEWLINE_KEY:
            return NEWLINE_KEY
    return None


def language_key(key: str) -> str | None:
    """A checkpoint key -> its name in `LanguageOnly` ("model.language_model.*", "lm_head.*"), or
    "image_newline" (the video's closing embedding), else None (the tower's are never read)."""
    if key in ("image_newline", "model.image_newline"):
        return NEWLINE_KEY
    return nested_language_key(key)


def _vision_part_class():
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
        LlavaOnevisionMultiModalProjector,
    )

    class _VisionPart(torch.nn.Module):
        """The encoder's part of `LlavaOnevisionModel` at its attribute names, with its own
        `get_video_features` / `get_image_features` (which read only these and `config`)."""

        def __init__(self, config, dtype: torch.dtype) -> None:
            from transformers import AutoModel

            super().__init__()
            self.config = config
            # dtype given as from_pretrained gives it to every sub-config (the vision config's own
            # `dtype`, if a checkpoint sets one, would win over the default dtype otherwise)
            self.vision_tower = AutoModel.from_config(config.vision_config, dtype=dtype)
            self.multi_modal_projector = LlavaOnevisionMultiModalProjector(config)
            self.image_newline = torch.nn.Parameter(torch.empty(config.text_config.hidden_size))

        get_video_features = LlavaOnevisionModel.get_video_features
        get_image_features = LlavaOnevisionModel.get_image_features
        apply_pooling = LlavaOnevisionModel.apply_pooling
        pack_image_features = LlavaOnevisionModel.pack_image_features

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
    """(`LanguageOnly` with the Qwen2 text model and lm_head, image_newline [hidden])."""
    root, files = safetensors_files(path)
    if not files:
        log.info("no safetensors in %s; loading the full model for its language model", root)
        model = load_full_model(str(root), dtype, torch.device("cpu"))
        newline = model.model.image_newline.data
        model.model.vision_tower = model.model.multi_modal_projector = None
        return model, newline
    model, extras = load_nested_language_model(root, files, path, hf_config, dtype, language_key)
    newline = extras.get(NEWLINE_KEY)
    if newline is None:
        raise ValueError(f"checkpoint {path} has no image_newline")
    return model, newline.to(dtype)


def resize_frame_to_size(vp, rgb: np.ndarray) -> np.ndarray:
    """One decoded frame [H, W, 3] uint8 resized by LLaVA-OneVision's video processor `vp` to its
    fixed `size` ([height, width, 3]), as its `preprocess` resizes it: the processor lays a video out
    as [T, 3, H, W] uint8 and torchvision resizes each frame's planes on their own (bicubic,
    antialias), so a frame alone comes out as among others, and at the target size torchvision
    returns the tensor unchanged, so `preprocess`'s own resize is then a no-op."""
    video = torch.from_numpy(rgb[None]).permute(0, 3, 1, 2).contiguous()  # [1, 3, H, W]
    resized = vp.resize(video, size=vp.size, resample=vp.resample)  # [1, 3, height, width]
    return resized[0].permute(1, 2, 0).contiguous().numpy()  # [height, width, 3]
