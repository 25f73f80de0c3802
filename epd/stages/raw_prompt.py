"""A prompt sent as it is, with no chat template: what OpenAI's legacy `POST /v1/completions`
(and the gRPC `AskHeader.prompt`) asks a model to continue. Plain Python, like the message model
beside it (`epd.stages.messages`): a request carries messages or a raw prompt, never both.

Its text is tokenised as the model's tokenizer tokenises text by default (transformers'
`tokenizer(text)`, special tokens added), or it is the token ids themselves; prefill runs it as it
runs a text-only conversation (no encoder, the positions `generate()` gives text), so the answer's
tokens are `model.generate(tokenizer(text).input_ids, do_sample=False)`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epd.stages.errors import InvalidRequest


@dataclass(frozen=True)
class RawPrompt:
    """The text to continue, or its token ids (one of the two)."""

    text: str = ""
    token_ids: tuple[int, ...] = ()


def check_raw_prompt(
    prompt: RawPrompt,
    messages: Sequence[object] = (),
    max_text_chars: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Raise InvalidRequest, saying what to change, unless `prompt` can be run: text or token ids
    (not both, not neither), no messages beside it, at most `max_text_chars` of text, every token
    id within the vocabulary (when the caller knows it)."""
    if messages:
        raise InvalidRequest("send a conversation (messages) or a raw prompt, not both")
    if prompt.text and prompt.token_ids:
        raise InvalidRequest("the prompt is text or token ids, not both; send one of them")
    if not prompt.text and not prompt.token_ids:
        raise InvalidRequest("the prompt is empty; send the text (or the token ids) to continue")
    if max_text_chars is not None and len(prompt.text) > max_text_chars:
        raise InvalidRequest(
            f"the prompt has {len(prompt.text)} characters; the limit is {max_text_chars}: "
            "send a shorter prompt"
        )
    bad = [t for t in prompt.token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f" (the vocabulary has {vocab_size} tokens)" if vocab_size is not None else ""
        raise InvalidRequest(f"the prompt's token ids {bad[:8]} are not token ids of this model{limit}")
