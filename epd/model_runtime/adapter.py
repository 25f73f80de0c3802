"""The contract between the serving stages and a vision-language model family.

A new family (LLaVA-OneVision, SmolVLM2, ...) is one file that implements `VLMAdapter`. The stages
call only these methods:

    encoder:  preprocess(frames) -> VisionInputs;  encode(VisionInputs) -> visual embeds
    prefill:  build_prompt(conversation, VisualMeta) -> Prompt;  prefill(Prompt, embeds) -> PrefillState
    decode:   decode_step(token_id, position_ids, cache) -> logits

Everything crossing a stage boundary is a plain tensor or a small dataclass, so it can be sent
over gRPC as dtype + shape + bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd.video.types import DecodedVideo

if TYPE_CHECKING:  # VisualMeta is read by the gateway, which starts without torch
    import torch

    from epd.model_runtime.kv_cache import KvCache


@dataclass
class VisionInputs:
    """Preprocessed pixels of one video or image."""

    modality: str  # "video" or "image"
    pixel_values: torch.Tensor  # [num_patches, C * temporal_patch * patch * patch]
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    second_per_grid_t: float  # seconds of video per temporal patch group (0 for images)


@dataclass(frozen=True)
class VisualMeta:
    """What prefill must know about visual tokens besides their embeddings."""

    modality: str
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    num_visual_tokens: int


@dataclass
class Prompt:
    """A tokenised, chat-templated prompt with the visual placeholders expanded."""

    input_ids: torch.Tensor  # [1, L] int64
    position_ids: torch.Tensor  # [4, 1, L] int64: row 0 text positions, rows 1-3 M-RoPE (t, h, w)
    visual_mask: torch.Tensor  # [L] bool, True at visual placeholder positions

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class PrefillState:
    """The output of prefill: the cache, the logits of the last position, the next positions."""

    cache: KvCache
    last_logits: torch.Tensor  # [vocab] float
    next_position_ids: torch.Tensor  # [4] int64: positions of the first generated token
    num_prompt_tokens: int
    stats: dict[str, float] = field(default_factory=dict)


class VLMAdapter(ABC):
    """One model family's implementation of the stage operations. Not thread-safe: one model
    call at a time (the services run model calls on a single executor thread)."""

    eos_token_ids: frozenset[int]
    hidden_size: int
    fingerprint: str  # identity of the loaded checkpoint, part of the token cache key
    supports_sparse_vision: bool = False  # the tower can run on a subset of patches

    def encode_sparse(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int],
                      position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """The tower on kept patches only (temporal dropping before the tower)."""
        raise NotImplementedError(f"{type(self).__name__} cannot encode a subset of patches")

    @abstractmethod
    def preprocess(self, video: DecodedVideo) -> VisionInputs:
        """Frames -> normalised patches, exactly as the model's own processor prepares them."""

    @abstractmethod
    def encode(self, inputs: VisionInputs) -> torch.Tensor:
        """Patches -> visual token embeddings [num_visual_tokens, hidden_size]."""

    @abstractmethod
    def num_visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """How many visual tokens (prompt placeholders) a grid yields."""

    @abstractmethod
    def build_prompt(self, conversation: list[dict[str, Any]], visual: VisualMeta) -> Prompt:
        """Render `conversation` exactly as the family's `processor.apply_chat_template(conversation,
        add_generation_prompt=True)` renders it, expand its one media placeholder to the visual
        tokens, compute the position ids `generate()` would use.

        conversation: the processor's chat form, [{"role": "system" | "user" | "assistant",
        "content": [{"type": "text", "text": ...} | {"type": visual.modality}, ...]}], parts in the
        user's order, exactly one media part (`epd.stages.messages.to_chat_template` makes it).
        Raises ValueError when a text part holds the model's own placeholder tokens."""

    @abstractmethod
    def prefill(self, prompt: Prompt, visual_embeds: torch.Tensor) -> PrefillState:
        """Run the language model over the prompt with `visual_embeds` [num_visual, hidden] in the
        placeholders; returns the KV cache and the last position's logits."""

    @abstractmethod
    def new_decode_cache(self, cache: KvCache):
        """Turn a transferred cache into the structure `decode_step` extends in place."""

    @abstractmethod
    def decode_step(self, token_id: int, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """One token in ([4] positions), logits [vocab] out; `cache` grows by one position."""

    @abstractmethod
    def detokenize(self, token_ids: list[int]) -> str:
        """Text of generated tokens, special tokens skipped."""
