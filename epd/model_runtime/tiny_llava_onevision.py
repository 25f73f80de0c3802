"""A tiny LLaVA-OneVision checkpoint's processor and model (`epd.model_runtime.tiny_model` builds
the checkpoint): a SigLIP tower, its projector and a Qwen2 language model, as
llava-onevision-qwen2-*-ov-hf, with llava-hf's chat template."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from epd.model_runtime.tiny_parts import SPECIAL_TOKENS, nested_text_config, scale_weights, train_tokenizer

if TYPE_CHECKING:
    from epd.model_runtime.tiny_model import TinyVLMSpec


# llava-hf's template (transformers' convert_llava_onevision_weights_to_hf.py): media first, then
# the text parts; no default system message. Special tokens: Qwen2's plus <image> and <video>.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}{% endfor %}"
    "{{'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAVA_ONEVISION_IMAGE_SIZE = 70  # SigLIP frames/crops of 70 px, patch 14: 5 x 5 patches (odd, like 27 x 27)
LLAVA_ONEVISION_PINPOINTS = [[70, 70], [70, 140], [140, 70], [140, 140], [70, 210], [210, 70]]


def build_llava_onevision_processor(spec: TinyVLMSpec):
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(spec.vocab_size, spec.extra_words),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[*SPECIAL_TOKENS[1:], "<image>", "<video>"],
    )
    tokenizer.chat_template = LLAVA_ONEVISION_CHAT_TEMPLATE
    side = LLAVA_ONEVISION_IMAGE_SIZE
    size = {"height": side, "width": side}
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size=size, image_grid_pinpoints=LLAVA_ONEVISION_PINPOINTS
        ),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=(side // 14) ** 2,
        vision_feature_select_strategy="full",
        chat_template=LLAVA_ONEVISION_CHAT_TEMPLATE,
    )


def build_llava_onevision_model(spec: TinyVLMSpec, tokenizer):
    """SigLIP tower + projector + Qwen2 language model, as llava-onevision-qwen2-*-ov-hf, tiny."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = nested_text_config(spec, tokenizer, "qwen2")
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=spec.vision_embed_dim,
        intermediate_size=spec.vision_embed_dim * 2,
        num_hidden_layers=spec.vision_depth,
        num_attention_heads=spec.vision_num_heads,
        image_size=LLAVA_ONEVISION_IMAGE_SIZE,
        patch_size=14,
        vision_use_head=False,
    )
    config = LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=LLAVA_ONEVISION_PINPOINTS,
        tie_word_embeddings=False,
    )
    config.eos_token_id = eos
    config.pad_token_id = pad
    torch.manual_seed(spec.seed)
    model = LlavaOnevisionForConditionalGeneration(config).eval()
    if spec.init == "hf":
        return model
    return scale_weights(model, spec, unit_vectors=(model.model.image_newline,))
