"""The pieces every tiny checkpoint builder shares (`epd.model_runtime.tiny_model` and its
families' builders): Qwen's special tokens, the byte-level BPE tokenizer trained on a small embedded
corpus, the language model's sizes taken from the spec, and the re-scaled random weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from epd.model_runtime.tiny_model import TinyVLMSpec

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


def train_tokenizer(
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


def nested_text_config(spec: TinyVLMSpec, tokenizer, model_type: str) -> dict[str, Any]:
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
