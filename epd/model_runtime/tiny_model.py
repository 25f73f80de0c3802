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


@dataclass(frozen=True)
class TinyVLMSpec:
    """Sizes of a built checkpoint. Defaults give a ~1M-parameter model that runs fast on a CPU."""

    family: str = "qwen2_vl"  # "qwen2_vl" or "qwen2_5_vl"
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


def _train_tokenizer(vocab_size: int, extra_words: tuple[str, ...] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
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

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec.vocab_size, spec.extra_words),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
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


def build_model(spec: TinyVLMSpec, tokenizer):
    """A randomly initialised model of the real class, its special token ids taken from `tokenizer`."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = max(len(tokenizer), spec.vocab_size)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=32768,
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
    else:
        raise ValueError(f"unknown model family {spec.family!r}; use 'qwen2_vl' or 'qwen2_5_vl'")
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    if spec.init not in ("scaled", "hf"):
        raise ValueError(f"unknown init {spec.init!r}; use 'scaled' or 'hf'")
    torch.manual_seed(spec.seed)
    model = cls(config).eval()
    if spec.init == "hf":
        return model
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, spec.weight_std / max(1.0, (param.shape[-1] / 64) ** 0.5))
    return model


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
    model.generation_config.eos_token_id = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
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
