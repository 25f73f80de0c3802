"""Checks of a request against the model and the served context that need its prompt or media,
before it queues (`PrefillEngine.render`): each raises the error that says what to change. No
gRPC here."""

from __future__ import annotations

from dataclasses import replace

from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.logprobs import MAX_PROMPT_LOGPROB_ENTRIES
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import EncodedMedia
from epd.stages.errors import InvalidRequest, ResourceExhausted


def check_visual(adapter: VLMAdapter, media: EncodedMedia) -> None:
    """The number of embeddings must match the grid (or the encoder's kept-token list):
    a mismatch means encoder and prefill serve different models, and fails this request."""
    meta, embeds = media.meta, media.embeds
    full = adapter.num_visual_tokens(meta.grid_thw)
    expected = full if media.token_index is None else int(media.token_index.numel())
    if (
        embeds.ndim != 2
        or embeds.shape[0] != expected
        or embeds.shape[1] != adapter.hidden_size
        or meta.num_visual_tokens != expected
    ):
        raise InvalidRequest(
            f"visual embeddings have shape {tuple(embeds.shape)}, expected "
            f"[{expected}, {adapter.hidden_size}]: encoder and prefill serve different models"
        )
    if (
        media.token_index is not None
        and media.token_index.numel()
        and (int(media.token_index.max()) >= full or bool((media.token_index.diff() <= 0).any()))
    ):
        raise InvalidRequest("kept_token_index must be increasing and within the grid's tokens")
    family = adapter.family or type(adapter).__name__
    if len(media.deepstack) != adapter.num_deepstack_layers:
        raise InvalidRequest(
            f"the media carries {len(media.deepstack)} DeepStack features but this {family} model "
            f"adds {adapter.num_deepstack_layers}: encoder and prefill serve different models"
        )
    if any(tuple(d.shape) != tuple(embeds.shape) for d in media.deepstack):
        raise InvalidRequest("each DeepStack feature must have the visual embeddings' shape, row for row")


def check_prompt_logprobs(adapter: VLMAdapter, exclusive: bool, num_prompt_tokens: int, k: int) -> None:
    """InvalidRequest when `prompt_logprobs` cannot be computed for this request: a family whose
    prefill has no per-position logits, or token dropping / KV compression, whose prompt runs
    gathered or layer by layer (the dropped positions would have no logits, and what is kept is
    not the prompt the model would see). ResourceExhausted past `MAX_PROMPT_LOGPROB_ENTRIES`, the
    memory one answer may take, before the prompt runs."""
    if not adapter.supports_prompt_logprobs:
        family = adapter.family or type(adapter).__name__
        raise InvalidRequest(f"this {family} model does not compute prompt_logprobs; leave it unset")
    if (num_entries := num_prompt_tokens * (k + 1)) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ResourceExhausted(
            f"prompt_logprobs={k} for a {num_prompt_tokens}-token prompt would be {num_entries} entries "
            f"(prompt tokens x (k + 1)), over the {MAX_PROMPT_LOGPROB_ENTRIES} one answer may hold (the "
            f"gateway's memory for it; at most {MAX_PROMPT_LOGPROB_ENTRIES // (k + 1)} prompt tokens at "
            "this k); ask for fewer top tokens, or send a shorter prompt"
        )
    if exclusive:
        raise InvalidRequest(
            "prompt_logprobs cannot be computed with token dropping or KV compression (the "
            "pruned prompt is not the one the model would see); turn pruning off or leave "
            "prompt_logprobs unset"
        )


def within_context(
    context_tokens: int | None, num_prompt_tokens: int, generation: GenerationConfig, raw: bool
) -> GenerationConfig:
    """`generation` as it fits the served context after a prompt of `num_prompt_tokens`: as
    asked, or, for a max_tokens left unset (`fit_max_new_tokens`), lowered to what the context
    leaves (vLLM's default max_tokens); InvalidRequest (vLLM's 400) saying what to change when
    it cannot fit. `raw`: a raw prompt's (the advice names a prompt, not a conversation)."""
    context = context_tokens
    if context is None or num_prompt_tokens + generation.max_new_tokens <= context:
        return generation
    shorter = "send a shorter prompt" if raw else "send a shorter conversation or fewer frames"
    if not generation.fit_max_new_tokens:
        raise InvalidRequest(
            f"this model's context is {context} tokens, but the request needs "
            f"{num_prompt_tokens + generation.max_new_tokens}: {num_prompt_tokens} in the prompt and up to "
            f"{generation.max_new_tokens} to generate (max_tokens); {shorter}, or ask for fewer tokens"
        )
    room = context - num_prompt_tokens  # tokens the answer may have
    if room >= max(1, generation.min_tokens):
        return replace(generation, max_new_tokens=room)
    # The client set no max_tokens: advice to ask for fewer would not help.
    said = f"this model's context is {context} tokens and the prompt has {num_prompt_tokens}"
    if room < 1:
        raise InvalidRequest(f"{said}, which leaves none for the answer: {shorter}")
    raise InvalidRequest(
        f"{said}, which leaves {room} for the answer, fewer than min_tokens "
        f"({generation.min_tokens}): lower min_tokens, or {shorter}"
    )
