"""What the front door's tokenize and detokenize (the HTTP API's /tokenize and /detokenize, vLLM's
routes of the same names, and the gRPC API's `GatewayService.Tokenize` / `Detokenize`) ask of
prefill, which holds the tokenizer and the chat template. Text only: a video or image part's tokens depend
on the frames sampled and their size, which only the encoder sees; a chat answer's
`usage.prompt_tokens` counts them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message, check_messages, media_type

MAX_DETOKENIZE_TOKENS = 262_144
"""Ids one detokenize takes at most (prefill's `max_text_chars` by default: what a longest
tokenize text could give); prefill checks its own bound too."""


@dataclass(frozen=True)
class TokenizeInput:
    prompt: str | None = None
    """A text, tokenised as it is (exactly one of `prompt` and `messages`)."""
    messages: Sequence[Message] = field(default_factory=tuple)
    """A conversation without media, rendered with the model's chat template as prefill renders a
    request's (with the default `template` and without special tokens, exactly a prompt's ids)."""
    add_special_tokens: bool = True
    """The tokenizer's special tokens around the text (vLLM: true for a prompt, false for messages)."""
    template: ChatTemplateOptions = ChatTemplateOptions()
    """messages only: how the chat template ends the conversation, as a chat request's (by default
    with the opening of the assistant's answer; `continue_final_message`: the last message left
    open, for the model to continue). Unlike a chat request's, any last role may be left open."""
    return_token_strs: bool = False
    """Also give each id's token string (the tokenizer's `convert_ids_to_tokens`, vLLM's `token_strs`)."""

    def check(self, max_text_chars: int) -> None:
        """InvalidRequest saying what to change, unless this is one text or text-only conversation
        of at most `max_text_chars` characters (prefill's bound on what the tokenizer is given)."""
        if (self.prompt is None) == (not self.messages):
            raise InvalidRequest("send exactly one of 'prompt' (a text) and 'messages' (a conversation)")
        if self.prompt is not None:
            if len(self.prompt) > max_text_chars:
                raise InvalidRequest(
                    f"the prompt has {len(self.prompt)} characters; the limit is {max_text_chars}"
                )
            if self.template != ChatTemplateOptions():
                # Refused, not ignored, as a raw prompt's ask refuses them (the HTTP API's prompt
                # body takes no template fields at all).
                raise InvalidRequest(
                    "add_generation_prompt, continue_final_message, chat_template_kwargs, chat_template and tools shape a chat "
                    "template's prompt; a prompt is tokenised as it is, without the template: leave them "
                    "unset, or send messages"
                )
            return
        # Any last role, as vLLM's /tokenize takes it: counting an assistant's turn, or the one a
        # client continues, is what a prompt-budgeting client asks.
        self.template.check(self.messages, to_answer=False)
        check_messages(self.messages, max_text_chars, to_answer=False)
        if media_type(self.messages):
            raise InvalidRequest(
                "tokenize counts text only: a video or image part's tokens depend on the frames the encoder "
                "samples; send the messages without it (a chat answer's usage.prompt_tokens counts them)"
            )


@dataclass(frozen=True)
class TokenizeOutput:
    token_ids: list[int]
    token_strs: list[str] | None = None
    """Each id's token string, when `return_token_strs` asked for them."""


@dataclass(frozen=True)
class TokenizeAnswer:
    """The front door's answer (the HTTP API's /tokenize, gRPC's `GatewayService.Tokenize`):
    prefill's `TokenizeOutput` and the served model's length (`epd.gateway.pipeline.Pipeline.tokenize`)."""

    token_ids: list[int]
    token_strs: list[str] | None
    """Each id's token string, when the request asked for them."""
    max_model_len: int | None
    """The longest prompt plus answer a request may have (vLLM's); None while prefill's model info
    is not known to the gateway."""


def check_token_ids(token_ids: Sequence[int], vocab_size: int | None, max_tokens: int) -> None:
    """InvalidRequest unless `token_ids` are at most `max_tokens` ids of the vocabulary."""
    if len(token_ids) > max_tokens:
        raise InvalidRequest(f"'tokens' has {len(token_ids)} ids; the limit is {max_tokens}")
    bad = next((t for t in token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        upper = (
            f"{vocab_size - 1} (this model's vocabulary)"
            if vocab_size is not None
            else "the vocabulary's last id"
        )
        raise InvalidRequest(f"tokens: token id {bad} is outside 0 to {upper}")
