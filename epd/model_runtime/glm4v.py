"""GLM-4.1V (dense, model_type glm4v) behind `VLMAdapter`, on transformers' own
`Glm4vForConditionalGeneration` (GLM-4.1V-9B-Thinking and -Base; GLM-4.5V is the MoE family,
glm4v_moe, not served here).

What differs from Qwen3-VL (`qwen3_vl.py`), and is reproduced here exactly as transformers 5.x does:
  * The tower attends within one frame and resamples learned position embeddings per grid
    (bicubic), then a 2x2 conv downsample and a gated merger: no DeepStack. It is called with one
    grid row (1, h, w) per temporal patch group, as `Glm4vModel.get_video_features` flattens a
    video's grid (the tower's position embeddings index one row per attention block), so a video's
    frame groups and an image mix in one tower call (`encode_batch`).
  * One placeholder token for both media: the template writes `<|video|>` (or `<|image|>`) inside
    `<|begin_of_video|>...<|end_of_video|>`; the processor expands the video into one
    `<|begin_of_image|><|image|>*n<|end_of_image|>{seconds}` per temporal group, `seconds` the
    whole seconds (int()) of the group's FIRST frame (`VideoMetadata.timestamps[::2]`; Qwen3-VL
    writes the mean of first and last as "<t seconds>"). So the visual tokens are `<|image|>`
    tokens for a video too, and which of them are video is told by the video markers around them
    (`Glm4vProcessor.create_mm_token_type_ids`, what `get_rope_index` reads).
  * Frames: the video processor's own sampling (2 fps, at most 300 s) is off; epd's decoded frames
    and their real times go in as they are (`group_timestamps`). Its resize bounds t x h x w over
    the whole clip, line for line Qwen3-VL's `smart_resize`, so frame groups are sized as their
    clip by Qwen3-VL's code (`clip_frame_size`, `frame_resizer`: the base class, `ClipResizeAdapter`).
  * Positions: `Glm4vModel.get_rope_index` places each temporal group like a separate image (t = 1)
    between the timestamp texts; the timestamps move no position (time_interval 1). Prefill
    positions are [4, 1, L] (text row + 3 M-RoPE rows); each decode step continues every row from
    its last prompt value + 1, as generate() does. The text model rotates half of each head
    (partial_rotary_factor 0.5, interleaved pairs) with sections (t, h, w) = (8, 12, 12) on the hub.
  * The chat template opens no thinking block: GLM-4.1V-Thinking writes `<think>...</think>` and
    then `<answer>...</answer>` itself; `--reasoning-parser deepseek_r1` parts it (docs/architecture.md).

Not supported (refused up front, `supported_pruning`): token pruning. The encoder-side stages are
written for Qwen's patch rows and tower, and the layer-by-layer prefill and query capture for
Qwen's decoder layers (GLM-4's carries two extra norms and rotates half of each head).
"""

from __future__ import annotations

from typing import Any

import torch

from epd.model_runtime.adapter import (
    Prompt,
    RenderOptions,
    TextDims,
    VisionInputs,
    VisualMeta,
)
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import end_of_sequence, fingerprint, load_language_model, load_vision_part
from epd.model_runtime.prompt_positions import mrope_prompt_positions
from epd.model_runtime.qwen3_vl import ClipResizeAdapter, expanded_ids
from epd.model_runtime.qwen_text_layers import count_parameters, dims_of
from epd.model_runtime.visual_placeholders import checked_visual_mask
from epd.video.types import DecodedVideo


class Glm4vAdapter(ClipResizeAdapter):
    """Loads only the parts a stage needs: "vision" (the tower with its downsample and merger)
    and/or "language" (embeddings, decoder layers, lm_head). From safetensors, a one-part stage
    reads only its own part's tensors; both parts load transformers' whole model."""

    family = "glm4v"
    family_label = "GLM-4.1V"
    supported_pruning = frozenset()
    pruning_refusal_reason = (
        "the pruning stages are written for Qwen's vision tower and decoder layers, and GLM-4.1V's "
        "differ (per-frame tower with resampled position embeddings; half-rotary layers with extra norms)"
    )
    supports_chunked_prefill = True  # `HfTextAdapter.prefill_chunks` over its M-RoPE padded forward

    def __init__(self, path: str, config: ModelConfig, parts: set[str]) -> None:
        from transformers import AutoConfig, AutoProcessor

        self.config = config
        self.parts = frozenset(parts)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.hf_config = AutoConfig.from_pretrained(path)
        if self.hf_config.model_type != self.family:
            raise ValueError(f"Glm4vAdapter loads model_type glm4v, not {self.hf_config.model_type!r}")
        self.processor = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.fingerprint = fingerprint(path)
        vision_config = self.hf_config.vision_config
        self.merge_size = vision_config.spatial_merge_size
        self.temporal_patch_size = vision_config.temporal_patch_size
        self.hidden_size = self.hf_config.text_config.hidden_size
        self._load_parts(path, _load_vision_tower, _load_language_model)
        self.eos_token_id, self.eos_token_ids = end_of_sequence(path, self.tokenizer)

    # -- encoder -----------------------------------------------------------------------------

    def group_timestamps(self, video: DecodedVideo) -> tuple[float, ...]:
        """Seconds of each temporal group's first frame, as the processor reads them from video
        metadata (fps = the source's, frames_indices = the decoded frames' indices in the source):
        what `processor(videos=..., video_metadata=...)` writes for these frames."""
        from transformers.video_utils import VideoMetadata

        fps = video.source_fps if video.source_fps > 0 else video.sampled_fps
        indices = [round(t * fps) for t in video.timestamps_s]
        metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=fps, frames_indices=indices)
        return tuple(float(t) for t in metadata.timestamps[:: self.temporal_patch_size])

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        return self.encode_batch([inputs])[0]

    @torch.inference_mode()
    def encode_batch(self, inputs: list[VisionInputs]) -> list[torch.Tensor]:
        """One tower call: patches concatenated, one grid row (1, h, w) per temporal group of each
        input (`get_video_features`' flattening; an image is one group), so nothing attends
        across groups; the tokens are split back per input, in order."""
        if self.visual is None:
            raise RuntimeError("this adapter was loaded without the vision tower")
        rows = [(1, h, w) for i in inputs for _ in range(i.grid_thw[0]) for h, w in [i.grid_thw[1:]]]
        grid = torch.tensor(rows, dtype=torch.long, device=self.device)
        pixels = torch.cat([i.pixel_values for i in inputs]).to(self.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid).pooler_output  # [sum tokens, hidden]
        return list(out.split([self.num_visual_tokens(i.grid_thw) for i in inputs]))

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
        input_ids = expanded_ids(self, conversation, visual, options, self.temporal_patch_size)
        # a video's tokens are `<|image|>` too
        visual_mask = checked_visual_mask(
            input_ids[0] == proc.image_token_id, self.num_visual_tokens(visual.grid_thw), proc.image_token
        )
        # The media markers around the placeholders tell a video's from an image's (what
        # get_rope_index reads); a text part's own markers must not turn one into the other.
        mm_types = torch.tensor(proc.create_mm_token_type_ids(input_ids.tolist()), dtype=torch.long)
        if not bool((mm_types[0][visual_mask] == (2 if visual.modality == "video" else 1)).all()):
            raise ValueError(
                "a text part holds GLM's media markers (<|begin_of_video|>, <|end_of_video|>); remove them"
            )
        return Prompt(input_ids, self._prompt_positions(input_ids, mm_types, visual), visual_mask)

    def _prompt_positions(
        self, input_ids: torch.Tensor, mm_types: torch.Tensor, visual: VisualMeta
    ) -> torch.Tensor:
        """[4, 1, L]: text row + M-RoPE rows, as generate's _prepare_position_ids_for_generation."""
        from transformers.models.glm4v.modeling_glm4v import Glm4vModel

        return mrope_prompt_positions(Glm4vModel, self.hf_config, input_ids, visual, mm_types)

    # -- sizes (the pruning stages themselves are refused: `supported_pruning`) ---------------

    @property
    def text_dims(self) -> TextDims:
        return dims_of(self.hf_config.text_config)

    @property
    def num_parameters(self) -> int:
        return count_parameters(self.model, self.visual)


def _load_vision_tower(path: str, hf_config, dtype: torch.dtype):
    """The tower (downsample and merger included) alone, only its tensors read ("model.visual.*")."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    return load_vision_part(
        path, hf_config, dtype, lambda: Glm4vVisionModel._from_config(hf_config.vision_config, dtype=dtype)
    )


def _load_language_model(path: str, hf_config, dtype: torch.dtype):
    """The GLM-4 text model and lm_head alone; the tower's tensors are never read."""
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextModel

    return load_language_model(path, hf_config, dtype, Glm4vTextModel)
