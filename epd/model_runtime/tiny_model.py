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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Qwen's special tokens, in Qwen's order, so the processor and chat template find them by name.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

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

# Words the tokenizer is trained on: the vocabulary of questions and answers about short clips.
_CORPUS_WORDS = (
    "what colour color is the shape object circle square triangle star red green blue yellow "
    "white black orange purple pink grey gray how many objects are there in video image frame "
    "which direction does it move left right up down appears first last enters leaves end "
    "happens at of a an and or to from on over under background moving static textured one two "
    "three four five six seven eight nine ten zero yes no describe this answer question you "
    "helpful assistant system user please briefly word words with without small large big "
    "bigger smaller top bottom middle center corner while after before then stops starts "
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


def _train_tokenizer(
    vocab_size: int, extra_words: tuple[str, ...] = (), special_tokens: list[str] = SPECIAL_TOKENS
):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS + "".join(f"{w} " for w in extra_words)
    corpus = [words, words.upper(), words.title()] * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


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
        return _build_llava_onevision_processor(spec)
    if spec.family == "glm4v":
        return _build_glm4v_processor(spec)
    if spec.family == "internvl":
        return _build_internvl_processor(spec)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size, spec.extra_words),
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
        return _build_llava_onevision_model(spec, tokenizer)
    if spec.family == "glm4v":
        return _build_glm4v_model(spec, tokenizer)
    if spec.family == "internvl":
        return _build_internvl_model(spec, tokenizer)
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


def text_sizes(spec: TinyVLMSpec, tokenizer) -> dict[str, int]:
    """The language model's sizes every family's text config takes from `spec`."""
    return dict(
        vocab_size=max(len(tokenizer), spec.vocab_size),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=32768,
    )


def scale_weights(model, spec: TinyVLMSpec, unit_vectors: tuple[torch.Tensor, ...] = ()):
    """`spec.init` "scaled": every matrix of `model` re-drawn with std `weight_std` (shrunk for wide
    inputs), so that a random model's greedy answers vary, and `unit_vectors` (parameters of
    `model`: LLaVA-OneVision's image_newline) re-drawn with std 1, in the parameters' order;
    returns the model."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, spec.weight_std / max(1.0, (param.shape[-1] / 64) ** 0.5))
            elif any(param is vector for vector in unit_vectors):
                param.normal_(0.0, 1.0)
    return model


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


# -- LLaVA-OneVision ------------------------------------------------------------------------------
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


def _build_llava_onevision_processor(spec: TinyVLMSpec):
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size, spec.extra_words),
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


def _build_llava_onevision_model(spec: TinyVLMSpec, tokenizer):
    """SigLIP tower + projector + Qwen2 language model, as llava-onevision-qwen2-*-ov-hf, tiny."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = _nested_text_config(spec, tokenizer, "qwen2")
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


# -- GLM-4.1V / GLM-4.5V (dense: glm4v) --------------------------------------------------------------
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


def _build_glm4v_processor(spec: TinyVLMSpec):
    """GLM-4.1V's processors: patch 14, merge 2 (sizes multiples of 28); the video processor's pixel
    bounds are over all frames together (t x h x w), as Qwen3-VL's; <think> and </think> added
    tokens that are not special, as in the hub's tokenizer."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size, spec.extra_words, GLM4V_SPECIAL_TOKENS),
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


def _build_glm4v_model(spec: TinyVLMSpec, tokenizer):
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


# -- InternVL -------------------------------------------------------------------------------------
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


def _build_internvl_processor(spec: TinyVLMSpec):
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLProcessor,
        InternVLVideoProcessor,
        PreTrainedTokenizerFast,
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size, spec.extra_words),
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


def _build_internvl_model(spec: TinyVLMSpec, tokenizer):
    """InternViT tower + pixel-shuffle projector + a Qwen3 (InternVL3.5), Qwen2 (InternVL3) or
    Llama (InternVL3-9B) language model (`spec.internvl_text_model`), as OpenGVLab/InternVL3_5-*-HF, tiny."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    if spec.internvl_text_model not in ("qwen3", "qwen2", "llama"):
        raise ValueError(
            f"unknown InternVL language model {spec.internvl_text_model!r}; use 'qwen3', 'qwen2' or 'llama'"
        )
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = _nested_text_config(spec, tokenizer, spec.internvl_text_model)
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


def _nested_text_config(spec: TinyVLMSpec, tokenizer, model_type: str) -> dict[str, Any]:
    """The text config of a LLaVA-style model's language model (`model_type` "qwen2", "qwen3" or "llama"),
    sized by `spec`, its special token ids taken from `tokenizer`."""
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text: dict[str, Any] = dict(
        model_type=model_type,
        **text_sizes(spec, tokenizer),
        eos_token_id=eos,
        bos_token_id=pad,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3":  # its config's default head_dim (128) is not hidden / heads
        text["head_dim"] = spec.hidden_size // spec.num_attention_heads
    return text
