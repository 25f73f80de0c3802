"""Build small Qwen2-VL / Qwen2.5-VL checkpoints offline, from the real architecture classes.

No weights can be downloaded on our machines, so the default model (until the trained demo model
exists) and every test model are built here: a byte-level BPE tokenizer trained with `tokenizers`
on a small embedded corpus, Qwen2-VL's image and video processors, a chat template in Qwen's
format, and a randomly initialised `Qwen2VLForConditionalGeneration` (or Qwen2.5-VL). The result is
saved with `save_pretrained` and is loaded back by the same `from_pretrained` path users run on a
real checkpoint.

The weights are scaled up from transformers' default initialisation (std 0.02) so that greedy
decoding does not collapse to one repeated token: the tests need outputs that vary, or an
equality check between two pipelines would prove little.

Here: the spec, the Qwen families and the checkpoint. The other families' processors and models are
built in tiny_llava_onevision.py, tiny_glm4v.py and tiny_internvl.py; what every family shares (the
tokenizer, the text sizes, the weight scaling) is in tiny_parts.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epd.model_runtime.tiny_glm4v import build_glm4v_model, build_glm4v_processor
from epd.model_runtime.tiny_internvl import build_internvl_model, build_internvl_processor
from epd.model_runtime.tiny_llava_onevision import (
    build_llava_onevision_model,
    build_llava_onevision_processor,
)
from epd.model_runtime.tiny_parts import SPECIAL_TOKENS, scale_weights, text_sizes, train_tokenizer

# Qwen2-VL's chat template, reduced to what a video/image question needs (system, user, assistant;
# content as a string or a list of {"type": "text" | "image" | "video"} parts).
CHAT_TEMPLATE = (
    "{% set has_system = messages[0]['role'] == 'system' %}"
    "{% if not has_system %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL-Instruct's chat template, reduced the same way: no default system message, and the
# media placeholder inside <|vision_start|>...<|vision_end|> as the real template writes it (its
# processor adds a pair per temporal group as well, so video prompts carry both, as on the hub).
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3.5's chat template, reduced the same way: Qwen3-VL's, and a generation prompt that opens a
# thinking block as the real template does (an empty one when `enable_thinking=False`).
QWEN3_5_CHAT_TEMPLATE = QWEN3_VL_CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}",
)

TINY_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava_onevision", "glm4v", "internvl")
"""The families `build_checkpoint` builds (Qwen3-VL MoE's tiny checkpoint is built from Qwen3-VL's
by tests/families.py's `build_qwen3_vl_moe_checkpoint`)."""


@dataclass(frozen=True)
class TinyVLMSpec:
    """Sizes of a built checkpoint. Defaults give a ~1M-parameter model that runs fast on a CPU."""

    family: str = "qwen2_vl"  # one of TINY_FAMILIES
    vocab_size: int = 512  # BPE vocabulary incl. special tokens (rounded up with unused ids)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_num_heads: int = 2
    # Frames are resized so that H*W stays within these bounds (multiples of 28 = patch 14 x merge 2).
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    weight_std: float = 0.3  # std of the re-initialised weights; large enough for varied output
    seed: int = 0
    init: str = "scaled"
    """"scaled": every matrix re-drawn with std `weight_std` (varied outputs of a random model, for
    tests); "hf": transformers' own initialisation (std 0.02), the starting point for training."""
    extra_words: tuple[str, ...] = ()
    """Words added to the tokenizer's training corpus (e.g. `epd.synth.questions.tokenizer_words()`),
    so that they tokenize as whole words."""
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    """Qwen3-VL only: the tower layers whose features are added after language layers 0, 1, ..."""
    qwen3_5_full_attention_interval: int = 2
    """Qwen3.5 only: every n-th language layer is full attention, the others Gated DeltaNet (the
    hub's models use 4; with 2, layers alternate linear, full, linear, full, ...)."""
    internvl_text_model: str = "qwen3"
    """InternVL only: its language model, "qwen3" (InternVL3.5's), "qwen2" (InternVL3's) or "llama"
    (InternVL3-9B's InternLM3, converted to Llama)."""


def build_processor(spec: TinyVLMSpec):
    """Tokenizer + image processor + video processor + chat template, as a Qwen2-VL processor."""
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    _check_family(spec)
    if spec.family == "llava_onevision":
        return build_llava_onevision_processor(spec)
    if spec.family == "glm4v":
        return build_glm4v_processor(spec)
    if spec.family == "internvl":
        return build_internvl_processor(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.extra_words),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    if spec.family == "qwen3_vl":
        return _build_qwen3_vl_processor(spec, tokenizer)
    if spec.family == "qwen3_5":  # Qwen3-VL's processor (what AutoProcessor maps qwen3_5 to)
        tokenizer.add_tokens(["<think>", "</think>"])
        processor = _build_qwen3_vl_processor(spec, tokenizer)
        processor.chat_template = processor.tokenizer.chat_template = QWEN3_5_CHAT_TEMPLATE
        return processor
    tokenizer.chat_template = CHAT_TEMPLATE
    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    image_processor = Qwen2VLImageProcessor(size=size)
    video_processor = Qwen2VLVideoProcessor(size=size)
    processor_cls = Qwen2_5_VLProcessor if spec.family == "qwen2_5_vl" else Qwen2VLProcessor
    return processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def _build_qwen3_vl_processor(spec: TinyVLMSpec, tokenizer):
    """Qwen3-VL's processors: patch 16 (merge 2, so sizes are multiples of 32); the video
    processor's pixel bounds are over all frames together, not per frame."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    image_size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    image_processor = Qwen2VLImageProcessor(size=image_size, patch_size=16, merge_size=2)
    video_size = {"shortest_edge": 64 * 64 * 2, "longest_edge": 128 * 128 * 64}
    video_processor = Qwen3VLVideoProcessor(
        size=video_size, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )


def build_model(spec: TinyVLMSpec, tokenizer):
    """A randomly initialised model of the real class, its special token ids taken from `tokenizer`."""
    _check_family(spec)
    if spec.family == "llava_onevision":
        return build_llava_onevision_model(spec, tokenizer)
    if spec.family == "glm4v":
        return build_glm4v_model(spec, tokenizer)
    if spec.family == "internvl":
        return build_internvl_model(spec, tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        **text_sizes(spec, tokenizer),
        # M-RoPE splits head_dim/2 rotary frequencies into (t, h, w) sections.
        rope_parameters={"rope_type": "default", "mrope_section": _mrope_section(spec)},
        eos_token_id=ids["<|im_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    common = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if spec.family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        vision: dict[str, Any] = dict(
            depth=spec.vision_depth,
            embed_dim=spec.vision_embed_dim,
            hidden_size=spec.hidden_size,
            num_heads=spec.vision_num_heads,
            mlp_ratio=2,
        )
        config = Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        cls = Qwen2VLForConditionalGeneration
    elif spec.family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_embed_dim,
            out_hidden_size=spec.hidden_size,
            intermediate_size=spec.vision_embed_dim * 2,
            num_heads=spec.vision_num_heads,
            fullatt_block_indexes=[spec.vision_depth - 1],
            window_size=56,
            tokens_per_second=2,
        )
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)  # type: ignore[assignment]
        cls = Qwen2_5_VLForConditionalGeneration  # type: ignore[assignment]
    elif spec.family == "qwen3_vl":
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        head_dim = spec.hidden_size // spec.num_attention_heads
        # rotary frequencies per head, interleaved t,h,w,t,h,w,... ([24, 20, 20] of 64 on the hub)
        half = head_dim // 2
        text["head_dim"] = head_dim
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [half - 2 * (half * 20 // 64), half * 20 // 64, half * 20 // 64],
            "mrope_interleaved": True,
        }
        vision = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_embed_dim,
            intermediate_size=spec.vision_embed_dim * 2,
            num_heads=spec.vision_num_heads,
            out_hidden_size=spec.hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,  # an 8 x 8 learned grid, resampled to each frame's grid
            deepstack_visual_indexes=list(spec.deepstack_visual_indexes),
        )
        config = Qwen3VLConfig(text_config=text, vision_config=vision, **common)  # type: ignore[assignment]
        cls = Qwen3VLForConditionalGeneration  # type: ignore[assignment]
    else:  # qwen3_5: every other family returned above or was refused (`_check_family`)
        config, cls = _qwen3_5_config(spec, text, common)
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    if spec.init not in ("scaled", "hf"):
        raise ValueError(f"unknown init {spec.init!r}; use 'scaled' or 'hf'")
    torch.manual_seed(spec.seed)
    model = cls(config).eval()
    return model if spec.init == "hf" else scale_weights(model, spec)


def _check_family(spec: TinyVLMSpec) -> None:
    if spec.family not in TINY_FAMILIES:
        *first, last = TINY_FAMILIES
        raise ValueError(
            f"unknown model family {spec.family!r}; use {', '.join(repr(f) for f in first)} or {last!r}"
        )


def _qwen3_5_config(spec: TinyVLMSpec, text: dict[str, Any], common: dict[str, Any]):
    """Qwen3.5: Gated DeltaNet (linear attention) layers and gated full-attention layers, one
    full-attention layer every `qwen3_5_full_attention_interval`; rotary on a quarter of each head
    (partial_rotary_factor 0.25, as the hub's), interleaved M-RoPE; Qwen3-VL's tower, no DeepStack."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    head_dim = 2 * spec.hidden_size // spec.num_attention_heads
    half = head_dim // 4 // 2  # rotary frequencies per head: a quarter of head_dim rotates
    interval = spec.qwen3_5_full_attention_interval
    text = dict(
        text,
        head_dim=head_dim,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(spec.num_hidden_layers)
        ],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [half - 2 * (half // 4), half // 4, half // 4],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_embed_dim,
        intermediate_size=spec.vision_embed_dim * 2,
        num_heads=spec.vision_num_heads,
        out_hidden_size=spec.hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
    )
    return Qwen3_5Config(text_config=text, vision_config=vision, **common), Qwen3_5ForConditionalGeneration


def _mrope_section(spec: TinyVLMSpec) -> list[int]:
    half = spec.hidden_size // spec.num_attention_heads // 2  # rotary frequencies per head
    t = half // 4
    hw = (half - t) // 2
    return [t + (half - t - 2 * hw), hw, hw]


def build_checkpoint(path: str | os.PathLike, spec: TinyVLMSpec = TinyVLMSpec()) -> Path:
    """Build and save model + processor under `path` (created); returns the path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    processor = build_processor(spec)
    model = build_model(spec, processor.tokenizer)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "epd_model_card.json").write_text(
        json.dumps(
            {
                "built_by": "epd.model_runtime.tiny_model",
                "spec": spec.__dict__,
                "note": "randomly initialised; its answers are meaningless",
            },
            indent=2,
        )
    )
    return out
