"""Qwen3-VL (dense) behind `VLMAdapter`, on transformers' own `Qwen3VLForConditionalGeneration`;
the MoE family (`qwen3_vl_moe.py`) subclasses it and differs only in its language model's MLPs.

What differs from Qwen2-VL (`qwen2_vl.py`), and is reproduced here exactly as transformers 5.x does:
  * DeepStack: the tower also returns one feature tensor per `deepstack_visual_indexes` layer
    ([num_visual_tokens, hidden] each, row i = visual token i). Language layer k adds feature k to
    its output at the visual positions, for the first len(deepstack) layers. So the encoder's
    output is `VisualFeatures(embeds, deepstack)`, not one tensor; `encode` alone would lose them
    and refuses (use `encode_features`).
  * Video prompts: the processor expands the one video placeholder into one
    `<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>` group per temporal patch, t the
    mean time of the group's first and last frame. The template's own
    `<|vision_start|>`/`<|vision_end|>` stay around all of it (both pairs are in the processor's
    output). We expand with the processor's own `replace_video_token` on the frames' times.
  * Positions: `get_rope_index` places each temporal group like a separate image (t = 1) between
    the timestamp texts; the rotary embedding interleaves the (t, h, w) frequencies. Prefill
    positions are [4, 1, L] (text row + 3 M-RoPE rows); each decode step continues every row from
    its last prompt value + 1, as generate() does.
No sparse (subset-of-patches) encoding: the tower resamples learned position embeddings per grid.
Batching: `encode_features_batch` runs one tower call for several frame groups and splits the
embeddings and every DeepStack feature back per group; `prefill_chunks` batches and chunks prompts,
each chunk adding the DeepStack rows of its own visual positions.

What other families share is in two base classes here, not borrowed method by method:
`ClipResizeAdapter` (frames sized by `smart_resize` of the whole clip, their pixels through the
family's processor, the visual token count) is GLM-4.1V's base too, and `Qwen3VLProcessorAdapter`
(group times and prompts of `Qwen3VLProcessor`) Qwen3.5's; `Qwen3VLAdapter` adds the tower with
DeepStack and its prefill.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from epd.model_runtime.adapter import (
    ChunkResult,
    LayerwisePass,
    PrefillChunk,
    PrefillState,
    Prompt,
    RenderOptions,
    UnsupportedByFamily,
    VisionInputs,
    VisualFeatures,
    VisualMeta,
)
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import (
    end_of_sequence,
    fingerprint,
    load_language_model,
    load_vision_part,
)
from epd.model_runtime.hf_text import HfTextAdapter
from epd.model_runtime.prompt_positions import mrope_prompt_positions
from epd.model_runtime.qwen_text import QwenTextAdapter
from epd.model_runtime.template_errors import check_media_placeholders
from epd.model_runtime.visual_placeholders import checked_visual_mask, placeholder_id
from epd.video.types import DecodedVideo, FrameResize, MediaError

log = logging.getLogger(__name__)


class ClipResizeAdapter(HfTextAdapter):
    """A family whose video processor sizes every frame of a clip by Qwen3-VL's `smart_resize` of
    the whole clip (t x h x w within its `size`): Qwen3-VL (and its MoE), Qwen3.5 and GLM-4.1V
    (whose processor's `smart_resize` is Qwen3-VL's line for line). So a frame group is resized to
    its clip's size here, and the decoder's frames are too (`frame_resizer`); `preprocess` gives
    the processor those frames for its own rescale, normalise and patchify, each family its
    `group_timestamps`."""

    merge_size: int
    temporal_patch_size: int
    # The family's video processor's own options beyond those `preprocess` sets.
    video_processor_options: Mapping[str, Any] = MappingProxyType({})

    def clip_frame_size(self, height: int, width: int, clip_num_frames: int) -> tuple[int, int]:
        """(height, width) the video processor gives every frame of a clip of `clip_num_frames`
        frames of height x width: its `smart_resize` on the whole clip, which bounds
        t x h x w by size.shortest_edge and size.longest_edge (no per-frame cap, as we call it)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        vp = self.processor.video_processor
        if clip_num_frames < vp.temporal_patch_size:  # smart_resize refuses it (generate() too)
            raise MediaError(  # a request sampling by fps gets 1 frame only with min_frames or max_frames 1
                f"this model ({self.family}) takes videos of at least {vp.temporal_patch_size} frames; "
                f"ask for num_frames >= {vp.temporal_patch_size} (sampling by fps: min_frames and max_frames "
                f">= {vp.temporal_patch_size})"
            )
        return smart_resize(
            clip_num_frames,
            height,
            width,
            temporal_factor=vp.temporal_patch_size,
            factor=vp.patch_size * vp.merge_size,
            min_pixels=vp.size.shortest_edge,
            max_pixels=vp.size.longest_edge,
        )

    def _resize_as_clip(self, video: DecodedVideo, clip_num_frames: int) -> torch.Tensor:
        """The frames [t, H, W, 3] uint8 resized as the processor resizes the whole clip: [t, 3, h, w]
        uint8. Frames the decoder already resized (`frame_resizer`) are returned as they are."""
        height, width = self.clip_frame_size(video.frames.shape[1], video.frames.shape[2], clip_num_frames)
        frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2).contiguous()  # [t, 3, H, W]
        return _processor_resize(self.processor.video_processor, frames, height, width)

    def frame_resizer(self, clip_num_frames: int) -> FrameResize | None:
        """The processor's resize of the whole clip, one frame at a time (`resize_frame_as_clip`):
        the target size depends on the clip's frame count, which the decoder knows from its plan
        before the first frame, and on the frame's size; torchvision resizes each frame's planes
        on their own, so a frame alone comes out as it does among the clip's."""
        if clip_num_frames < self.processor.video_processor.temporal_patch_size:
            return None  # `preprocess` refuses the clip, with its own message
        return partial(resize_frame_as_clip, self, clip_num_frames)

    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def preprocess(self, video: DecodedVideo, clip_num_frames: int | None = None) -> VisionInputs:
        if video.is_image:
            out = self.processor.image_processor(images=[video.frames[0]], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return VisionInputs("image", out["pixel_values"], grid, 0.0)  # type: ignore[arg-type]
        # Resized here to the whole clip's size, then the processor's own rescale, normalise and
        # patchify: its resize would size the group alone, and its bounds are over t x h x w.
        # A 1-frame tail group is padded by patchify repeating the frame, as the clip's tail is.
        frames = self._resize_as_clip(video, clip_num_frames or video.num_frames)  # [t, 3, h, w] uint8
        out = self.processor.video_processor(
            videos=[frames],
            do_sample_frames=False,
            do_resize=False,
            return_tensors="pt",
            **self.video_processor_options,
        )
        grid = tuple(int(x) for x in out["video_grid_thw"][0])
        return VisionInputs(
            "video",
            out["pixel_values_videos"],
            grid,  # type: ignore[arg-type]
            second_per_grid_t=self.temporal_patch_size / video.sampled_fps,
            group_timestamps_s=self.group_timestamps(video),
        )

    @abstractmethod
    def group_timestamps(self, video: DecodedVideo) -> tuple[float, ...]:
        """Seconds of each temporal group, as the family's processor writes them in the prompt."""


class Qwen3VLProcessorAdapter(ClipResizeAdapter):
    """A family on Qwen3-VL's processor (`Qwen3VLProcessor`): Qwen3-VL (and its MoE) and Qwen3.5.
    Their group times and prompts (the processor's template and its timestamped expansion) are
    this code, their pixels `ClipResizeAdapter.preprocess`; their positions come from their own
    model class's `get_rope_index` (`_prompt_positions`)."""

    # Its resize is off (`preprocess`; `clip_frame_size` sizes the frames, without a per-frame
    # cap), so False changes no pixel: said, it silences the warning that the default will change.
    video_processor_options = MappingProxyType({"cap_pixels_per_frame": False})

    def group_timestamps(self, video: DecodedVideo) -> tuple[float, ...]:
        """Seconds of each temporal group as the processor computes them from video metadata
        (fps = the source's, frames_indices = the decoded frames' indices in the source): what
        `processor(videos=..., video_metadata=...)` writes for these frames."""
        fps = video.source_fps if video.source_fps > 0 else video.sampled_fps
        indices = [round(t * fps) for t in video.timestamps_s]
        times = self.processor._calculate_timestamps(indices, fps, self.temporal_patch_size)
        return tuple(float(t) for t in times)

    def build_prompt(
        self,
        conversation: list[dict[str, Any]],
        visual: VisualMeta | None,
        options: RenderOptions = RenderOptions(),
    ) -> Prompt:
        if visual is None:
            return self._text_only_prompt(conversation, options)
        input_ids = expanded_ids(self, conversation, visual, options, self.temporal_patch_size)
        pad = self.processor.video_token if visual.modality == "video" else self.processor.image_token
        visual_mask = checked_visual_mask(
            input_ids[0] == placeholder_id(self.hf_config, visual.modality),
            self.num_visual_tokens(visual.grid_thw),
            pad,
        )
        return Prompt(input_ids, self._prompt_positions(input_ids, visual), visual_mask)

    @abstractmethod
    def _prompt_positions(self, input_ids: torch.Tensor, visual: VisualMeta) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""


class Qwen3VLAdapter(Qwen3VLProcessorAdapter, QwenTextAdapter):
    """Loads only the parts a stage needs: "vision" (the tower with its DeepStack mergers) and/or
    "language" (embeddings, decoder layers, lm_head). From safetensors, a one-part stage reads only
    its own part's tensors; both parts load transformers' whole model."""

    family = "qwen3_vl"  # the config.json model_type this class loads (a subclass names its own)
    family_label = "Qwen3-VL"  # the family in messages
    supported_pruning = frozenset({"temporal_drop", "key_tokens"})
    pruning_refusal_reason = (
        "it cannot keep the DeepStack features aligned with the visual tokens those stages merge or drop"
    )

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = AutoConfig.from_pretrained(path)
        if self.hf_config.model_type != self.family:
            raise ValueError(
                f"{type(self).__name__} loads model_type {self.family}, not {self.hf_config.model_type!r}"
            )
        self.processor = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.fingerprint = fingerprint(path)
        vision_config = self.hf_config.vision_config
        self.merge_size = vision_config.spatial_merge_size
        self.temporal_patch_size = vision_config.temporal_patch_size
        self.num_deepstack_layers = len(vision_config.deepstack_visual_indexes)
        self.hidden_size = self.hf_config.text_config.hidden_size
        self._load_parts(path, self._load_vision_tower, self._load_language_model)
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    def _hf_classes(self) -> tuple[Any, Any, Any]:
        """transformers' (model, vision tower, text model) classes of this family: the owner of
        `get_rope_index` and what the one-part stages build."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            Qwen3VLModel,
            Qwen3VLTextModel,
            Qwen3VLVisionModel,
        )

        return Qwen3VLModel, Qwen3VLVisionModel, Qwen3VLTextModel

    def _load_vision_tower(self, path: str, hf_config, dtype: torch.dtype):
        """The tower (with its merger and DeepStack mergers) alone, only its tensors read."""
        vision_cls = self._hf_classes()[1]
        return load_vision_part(
            path, hf_config, dtype, lambda: vision_cls._from_config(hf_config.vision_config, dtype=dtype)
        )

    def _load_language_model(self, path: str, hf_config, dtype: torch.dtype):
        """The text model and lm_head alone, at the whole model's attribute paths; the tower's tensors
        are never read (the 2B/4B checkpoints tie the head to the embeddings)."""
        return load_language_model(path, hf_config, dtype, self._hf_classes()[2])

    # -- encoder -----------------------------------------------------------------------------

    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        raise NotImplementedError(
            "Qwen3-VL's tower also yields DeepStack features that prefill needs; call encode_features"
        )

    @torch.inference_mode()
    def encode_features(self, inputs: VisionInputs) -> VisualFeatures:
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([inputs.grid_thw], dtype=torch.long, device=self.device)
        out = self.visual(inputs.pixel_values.to(self.device, self.visual.dtype), grid_thw=grid)
        # pooler_output [t * h/2 * w/2, hidden]; deepstack_features: one of the same shape per layer
        return VisualFeatures(out.pooler_output, list(out.deepstack_features))

    @torch.inference_mode()
    def encode_features_batch(self, inputs: list[VisionInputs]) -> list[VisualFeatures]:
        """One tower call for several frame groups / images: patches concatenated, one grid row
        each (the tower attends within each row's temporal groups and interpolates its position
        embeddings per row, as for one input); the embeddings and every DeepStack feature are
        split back per input, row i of each still visual token i of that input."""
        if len(inputs) == 1:
            return [self.encode_features(inputs[0])]
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        grid = torch.tensor([i.grid_thw for i in inputs], dtype=torch.long, device=self.device)
        pixels = torch.cat([i.pixel_values for i in inputs]).to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid)
        sizes = [self.num_visual_tokens(i.grid_thw) for i in inputs]
        embeds = out.pooler_output.split(sizes)  # per input [tokens_j, hidden]
        deepstack = [feature.split(sizes) for feature in out.deepstack_features]  # [layer][input]
        return [VisualFeatures(embeds[j], [d[j] for d in deepstack]) for j in range(len(inputs))]

    # -- prefill -----------------------------------------------------------------------------

    def _prompt_positions(self, input_ids: torch.Tensor, visual: VisualMeta) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""
        return mrope_prompt_positions(self._hf_classes()[0], self.hf_config, input_ids, visual)

    @torch.inference_mode()
    def prefill(
        self, prompt: Prompt, visual_embeds: torch.Tensor, deepstack: list[torch.Tensor] | None = None
    ) -> PrefillState:
        """deepstack: `encode_features`' DeepStack features, rows aligned with `visual_embeds`.
        None runs the language model without them: not what generate() computes (the tests'
        negative control); the stages pass them through `prefill_features`."""
        extra: dict[str, Any] = {}
        if deepstack is not None:
            if len(deepstack) != self.num_deepstack_layers:
                raise ValueError(
                    f"{len(deepstack)} DeepStack features; this model adds {self.num_deepstack_layers}"
                )
            if any(d.shape != visual_embeds.shape for d in deepstack):
                raise ValueError("DeepStack features must have the visual embeddings' shape, row for row")
            extra = {
                "visual_pos_masks": prompt.visual_mask.to(self.device)[None],  # [1, L]
                "deepstack_visual_embeds": [d.to(self.device) for d in deepstack],
            }
        return self._prefill_whole(prompt, visual_embeds, **extra)

    def prefill_features(self, prompt: Prompt, features: VisualFeatures) -> PrefillState:
        if features.deepstack is None:
            raise ValueError("Qwen3-VL needs the tower's DeepStack features beside the visual embeddings")
        return self.prefill(prompt, features.embeds, features.deepstack)

    supports_chunked_prefill = True

    @torch.inference_mode()
    def prefill_chunks(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """As Qwen2-VL's (rows without a cache share one right-padded forward, a continuing chunk
        runs alone after its cache), with DeepStack: each row's features for the visual positions
        of its own chunk are added, in the order the model indexes them ([B, L] mask, row-major)."""
        for row in rows:
            if row.deepstack is None or len(row.deepstack) != self.num_deepstack_layers:
                raise ValueError(
                    f"Qwen3-VL's prefill needs DeepStack features ({self.num_deepstack_layers} per row); "
                    f"a row has {0 if row.deepstack is None else len(row.deepstack)}"
                )
        return super().prefill_chunks(rows)

    def _chunk_inputs(self, row: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Tokens [start, end) of the row: embeddings [n, hidden] with the visual placeholders
        filled, the visual mask [n] bool, and each DeepStack feature's rows of those placeholders."""
        lm = self._language_model()
        embeds = lm.embed_tokens(row.prompt.input_ids[0, row.start : row.end].to(self.device))  # [n, H]
        visual = row.prompt.visual_mask[row.start : row.end]  # [n] bool
        first = int(row.prompt.visual_mask[: row.start].sum())  # visual tokens of earlier chunks
        num = int(visual.sum())
        if num:
            embeds[visual.to(self.device)] = row.visual_embeds[first : first + num].to(
                self.device, embeds.dtype
            )
        assert row.deepstack is not None
        return embeds, visual, [d[first : first + num].to(self.device) for d in row.deepstack]

    def _prefill_padded(self, rows: list[PrefillChunk]) -> list[ChunkResult]:
        """Rows from token 0, right-padded to the longest ([B, L]); causal attention keeps the
        padding (after each row's tokens) out of every valid token's view."""
        from transformers import DynamicCache

        lengths = [row.end for row in rows]
        visual_mask = torch.zeros(len(rows), max(lengths), dtype=torch.bool)  # [B, L]
        row_embeds: list[torch.Tensor] = []  # [n_i, H] each
        deepstack: list[list[torch.Tensor]] = [[] for _ in range(self.num_deepstack_layers)]
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            embeds, row_visual, row_deepstack = self._chunk_inputs(row)
            row_embeds.append(embeds)
            visual_mask[i, :n] = row_visual
            for layer, rows_of_layer in zip(deepstack, row_deepstack, strict=True):
                layer.append(rows_of_layer)  # row-major: the order of embeds[visual_mask]
        cache = DynamicCache(config=self.hf_config.text_config)
        out = self._language_model()(
            inputs_embeds=self._padded_embeds(row_embeds),  # [B, L, H]
            position_ids=self._padded_mrope_positions(rows).to(self.device),  # [4, B, L]
            past_key_values=cache,
            use_cache=True,
            visual_pos_masks=visual_mask.to(self.device),
            deepstack_visual_embeds=[torch.cat(layer) for layer in deepstack],
        )
        return self._padded_results(cache, out.last_hidden_state, rows)

    def _prefill_continue(self, row: PrefillChunk) -> ChunkResult:
        """Tokens [start, end) after the row's cache of [0, start), which grows in place."""
        self._check_continues(row)
        embeds, visual, deepstack = self._chunk_inputs(row)
        out = self._language_model()(
            inputs_embeds=embeds[None],
            position_ids=row.prompt.position_ids[:, :, row.start : row.end].to(self.device),
            attention_mask=torch.ones(1, row.end, dtype=torch.long, device=self.device),
            past_key_values=row.cache,
            use_cache=True,
            visual_pos_masks=visual[None].to(self.device),
            deepstack_visual_embeds=deepstack,
        )
        return self._continued_result(row, out.last_hidden_state)

    # -- pruning interface -------------------------------------------------------------------
    # Query capture works (the shared hooks apply the attention's q/k norm). The layer-by-layer
    # prefill (prefill drop, KV compression) is refused: it would have to add the DeepStack
    # features to the survivors at the first layers, and the pruned prefill does not carry them.
    # (Encode-stage dropping runs whole through `prefill_features`, prefill_svc/whole_prefill.py.)

    def layerwise_prefill(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> LayerwisePass:
        raise UnsupportedByFamily(
            f"{self.family_label} ({self.family}) cannot run the prefill drop or KV compression: its "
            "layer-by-layer prefill does not add DeepStack features yet"
        )


def expanded_ids(
    adapter: HfTextAdapter,
    conversation: list[dict[str, Any]],
    visual: VisualMeta,
    options: RenderOptions,
    temporal_patch_size: int,
) -> torch.Tensor:
    """[1, L]: the adapter's chat template of `conversation` with its one media placeholder
    expanded by the processor's own code, as its __call__ does (a video's group timestamps
    included: `timestamps_metadata`), tokenised as it tokenises it. Qwen3-VL's (and its MoE's),
    Qwen3.5's and GLM-4.1V's: their processors expand alike."""
    proc = adapter.processor
    text = adapter._render(conversation, options)
    pad = proc.video_token if visual.modality == "video" else proc.image_token
    check_media_placeholders(text, proc, visual.modality, options)
    grid = torch.tensor([visual.grid_thw], dtype=torch.long)
    if visual.modality == "video":
        metadata = timestamps_metadata(visual, temporal_patch_size)
        expanded = proc.replace_video_token(
            {"video_grid_thw": grid, "video_metadata": [metadata]}, video_idx=0
        )
    else:
        expanded = proc.replace_image_token({"image_grid_thw": grid}, image_idx=0)
    text = text.replace(pad, expanded, 1)
    input_ids = adapter.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    options.between_steps()  # expanded and tokenised; the positions next (every caller's)
    return input_ids


def timestamps_metadata(visual: VisualMeta, temporal_patch_size: int):
    """VideoMetadata whose frame times give `visual.group_timestamps_s` back through the
    processor's reading of them (Qwen3-VL averages each group's frames, GLM-4.1V takes its first):
    each group's time repeated over its `temporal_patch_size` frames at 1 frame/s. Without times,
    evenly spaced frames from 0 s at `second_per_grid_t` seconds per group."""
    from transformers.video_utils import VideoMetadata

    num_groups = visual.grid_thw[0]
    tp = temporal_patch_size
    if visual.group_timestamps_s:
        if len(visual.group_timestamps_s) != num_groups:
            raise ValueError(
                f"{len(visual.group_timestamps_s)} group timestamps for {num_groups} temporal groups"
            )
        # "frame indices" in seconds at 1 frame/s: the processor's idx / fps is then the time itself
        times = [t for t in visual.group_timestamps_s for _ in range(tp)]
        return VideoMetadata(total_num_frames=len(times), fps=1.0, frames_indices=times)  # type: ignore[arg-type]
    fps = tp / visual.second_per_grid_t
    return VideoMetadata(
        total_num_frames=num_groups * tp, fps=fps, frames_indices=list(range(num_groups * tp))
    )


def _processor_resize(vp, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[t, 3, H, W] uint8 -> [t, 3, height, width] uint8 by the torchvision resize the video
    processor's `resize` calls (its interpolation, antialiased); each frame's planes are resized
    on their own, and a tensor already of that size is returned unchanged."""
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    return TorchvisionBackend.resize(vp, frames, SizeDict(height=height, width=width), resample=vp.resample)


def resize_frame_as_clip(adapter: ClipResizeAdapter, clip_num_frames: int, rgb: np.ndarray) -> np.ndarray:
    """One decoded frame [H, W, 3] uint8 resized as `adapter.preprocess` resizes every frame of a
    clip of `clip_num_frames` frames of this size ([h, w, 3], h and w from `clip_frame_size`), or
    `rgb` itself where `preprocess` would not leave the resized frame as it is.

    `preprocess` sizes the frames it gets by their own h x w and the clip's count; given resized
    frames, that must give (h, w) again, and torchvision then returns them unchanged. smart_resize
    is not always a fixed point: it compares the count rounded to temporal pairs (4 for 3 frames)
    x h x w with the bound but scales by the count itself, so 3 frames of 1080p on the tiny
    checkpoint go to 416x768 and then to 416x800 (with the hub checkpoints' 25 Mpx bound, 35 of
    268,260 (size, count) pairs, all 3-frame clips near 4K). Those frames stay as decoded, and so
    do frames smart_resize refuses (aspect over 200: `preprocess` raises its own error).
    """
    height, width = rgb.shape[:2]
    try:
        target = adapter.clip_frame_size(height, width, clip_num_frames)
    except ValueError:
        return rgb
    if target == (height, width) or adapter.clip_frame_size(*target, clip_num_frames) != target:
        return rgb
    # [1, 3, H, W], as preprocess lays it out
    frame = torch.from_numpy(rgb).permute(2, 0, 1).contiguous()[None]
    resized = _processor_resize(adapter.processor.video_processor, frame, *target)  # [1, 3, h, w]
    return resized[0].permute(1, 2, 0).contiguous().numpy()  # [h, w, 3]
