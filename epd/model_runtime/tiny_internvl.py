"""A tiny InternVL checkpoint's processor and model (`epd.model_runtime.tiny_model` builds the
checkpoint): InternViT, its pixel-shuffle projector and a Qwen3, Qwen2 or Llama language model, with
the chat template of the OpenGVLab/InternVL3*-hf checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epd.model_runtime.tiny_parts import SPECIAL_TOKENS, nested_text_config, scale_weights, train_tokenizer

if TYPE_CHECKING:
    from epd.model_runtime.tiny_model import TinyVLMSpec


# The template of the OpenGVLab/InternVL3*-hf checkpoints (transformers' convert_internvl_weights_to_hf.py),
# with the image placeholder the processor expands (`<IMG_CONTEXT>`): each media part, then its
# text, in the user's order; no default system message. Special tokens: Qwen's plus InternVL's
# <img>, </img>, <IMG_CONTEXT> and <video>, named as the hub's tokenizer names them
# (`extra_special_tokens`, which InternVLProcessor reads).
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# InternViT tiles and frames of 112 px, patch 14: 8 x 8 patches, pixel-shuffled (0.5) to 4 x 4 =
# 16 tokens each (448 px, 32 x 32 -> 256 on the hub). Images: up to 6 tiles and a thumbnail (12 on the hub).
INTERNVL_IMAGE_SIZE = 112
INTERNVL_MAX_TILES = 6


def build_internvl_processor(spec: TinyVLMSpec):
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLProcessor,
        InternVLVideoProcessor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.extra_words),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[*SPECIAL_TOKENS[1:], *INTERNVL_TOKENS.values()],
        extra_special_tokens=INTERNVL_TOKENS,
    )
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    side = INTERNVL_IMAGE_SIZE
    size = {"height": side, "width": side}
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as the hub's processors
    return InternVLProcessor(
        # crop_to_patches left at the image processor's default (off), as the hub's: InternVLProcessor
        # turns it on for its own calls, which the adapter must reproduce
        image_processor=GotOcr2ImageProcessor(
            size=size,
            min_patches=1,
            max_patches=INTERNVL_MAX_TILES,
            image_mean=mean,
            image_std=std,
        ),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=size, image_mean=mean, image_std=std),
        image_seq_length=(side // 14 // 2) ** 2,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def build_internvl_model(spec: TinyVLMSpec, tokenizer):
    """InternViT tower + pixel-shuffle projector + a Qwen3 (InternVL3.5), Qwen2 (InternVL3) or
    Llama (InternVL3-9B) language model (`spec.internvl_text_model`), as OpenGVLab/InternVL3_5-*-HF, tiny."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    if spec.internvl_text_model not in ("qwen3", "qwen2", "llama"):
        raise ValueError(
            f"unknown InternVL language model {spec.internvl_text_model!r}; use 'qwen3', 'qwen2' or 'llama'"
        )
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = nested_text_config(spec, tokenizer, spec.internvl_text_model)
    vision = dict(
        hidden_size=spec.vision_embed_dim,
        intermediate_size=spec.vision_embed_dim * 2,
        num_hidden_layers=spec.vision_depth,
        num_attention_heads=spec.vision_num_heads,
        image_size=INTERNVL_IMAGE_SIZE,
        patch_size=14,
    )
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        image_seq_length=(INTERNVL_IMAGE_SIZE // 14 // 2) ** 2,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    config.eos_token_id = eos
    config.pad_token_id = pad
    torch.manual_seed(spec.seed)
    model = InternVLForConditionalGeneration(config).eval()
    if spec.init == "hf":
        return model
    scale_weights(model, spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # Qwen3's per-head query/key norms (weights of one) keep a random model's attention
                # nearly uniform and its greedy answer one repeated token; doubled, it varies.
                param.fill_(2.0)
    return model
