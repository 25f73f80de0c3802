"""A prompt's visual placeholder tokens: their id in the model's config, and the checks that their
count is the media's (the checkpoint's tokenizer) and the visual embeddings'."""

from __future__ import annotations

import torch

from epd.model_runtime.adapter import Prompt


def placeholder_id(hf_config, modality: str) -> int:
    """The config's token id of `modality`'s placeholder ("video" or "image"), as the model's own
    embedding and `get_rope_index` read it (Qwen2-VL's and Qwen3-VL's families). Read from the
    config, not the tokenizer: a tokenizer that lacks the placeholder then gets
    `checked_visual_mask`'s message, not a comparison with None."""
    return hf_config.video_token_id if modality == "video" else hf_config.image_token_id


def checked_visual_mask(visual_mask: torch.Tensor, num_visual: int, placeholder: str) -> torch.Tensor:
    """`visual_mask` [L] (the expanded prompt's `placeholder` tokens), unless they are not the
    grid's `num_visual`. A text part's placeholder and a template's own are refused before
    (`_render`, `check_media_placeholders`), and the expansion writes `num_visual` of them, so a
    count that differs is the checkpoint's: its tokenizer splits or merges the placeholder (not
    one added token), or gives it another id than the one the mask is read by (the processor's or
    the model config's). Nothing in the request can change that: RuntimeError, INTERNAL to the
    client, the message (what the operator should check) in the server log with the traceback."""
    found = int(visual_mask.sum())
    if found != num_visual:
        raise RuntimeError(
            f"the model's tokenizer gave {found} {placeholder} tokens for the {num_visual} that the "
            f"prompt's media expanded to: check that the checkpoint's tokenizer has {placeholder} as "
            "one added token (tokenizer.json's added_tokens) with the id its processor and config give it"
        )
    return visual_mask


def check_visual_count(prompt: Prompt, visual_embeds: torch.Tensor) -> None:
    """ValueError unless `visual_embeds` [n, hidden] has one row per visual position of `prompt`."""
    num_visual = int(prompt.visual_mask.sum())
    if visual_embeds.shape[0] != num_visual:
        raise ValueError(f"{visual_embeds.shape[0]} visual embeddings for {num_visual} visual positions")
