"""A tiny GLM-4.1V / GLM-4.5V (dense: glm4v) checkpoint's processor and model
(`epd.model_runtime.tiny_model` builds the checkpoint), with GLM-4.1V's chat template and special tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epd.model_runtime.tiny_parts import scale_weights, text_sizes, train_tokenizer

if TYPE_CHECKING:
    from epd.model_runtime.tiny_model import TinyVLMSpec


# GLM-4.1V-9B-Thinking's template, reduced the same way: "[gMASK]<sop>", role tokens with no closing
# token, each media part as <|begin_of_video|><|video|><|end_of_video|> (or the image's), and a
# generation prompt "<|assistant|>\n" after which the model opens its own <think> block.
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n{% else %}<|{{ message['role'] }}|>\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GLM4V_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]
# The hub checkpoints stop at any of these (generation_config.json's eos_token_id list).
GLM4V_EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]


def build_glm4v_processor(spec: TinyVLMSpec):
    """GLM-4.1V's processors: patch 14, merge 2 (sizes multiples of 28); the video processor's pixel
    bounds are over all frames together (t x h x w), as Qwen3-VL's; <think> and </think> added
    tokens that are not special, as in the hub's tokenizer."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.extra_words, GLM4V_SPECIAL_TOKENS),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=GLM4V_SPECIAL_TOKENS[1:],
    )
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = GLM4V_CHAT_TEMPLATE
    image_size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    video_size = {"shortest_edge": 56 * 56 * 2, "longest_edge": 112 * 112 * 64}
    return Glm4vProcessor(
        image_processor=Glm4vImageProcessor(size=image_size),  # patch 14, merge 2, temporal 2: the defaults
        tokenizer=tokenizer,
        video_processor=Glm4vVideoProcessor(size=video_size),
        chat_template=GLM4V_CHAT_TEMPLATE,
    )


def build_glm4v_model(spec: TinyVLMSpec, tokenizer):
    """GLM-4.1V's tower (per-frame attention, learned position embeddings resampled to each grid, a
    conv downsample and a gated merger) and GLM-4's text model (partial rotary M-RoPE), tiny."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GLM4V_SPECIAL_TOKENS}
    eos = [ids[t] for t in GLM4V_EOS_TOKENS]
    head_dim = spec.hidden_size // spec.num_attention_heads
    half = head_dim // 2 // 2  # rotary frequencies per head: half of head_dim rotates (as the hub's)
    text = dict(
        **text_sizes(spec, tokenizer),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [half - 2 * (half * 12 // 32), half * 12 // 32, half * 12 // 32],
        },
        eos_token_id=eos,
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_embed_dim,
        num_heads=spec.vision_num_heads,
        out_hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        image_size=112,  # an 8 x 8 learned position grid, resampled to each frame's grid
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    config = Glm4vConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    config.eos_token_id = eos
    config.pad_token_id = ids["<|endoftext|>"]
    torch.manual_seed(spec.seed)
    model = Glm4vForConditionalGeneration(config).eval()
    return model if spec.init == "hf" else scale_weights(model, spec)
