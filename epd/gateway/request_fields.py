"""Which fields of a request body the server reads, refuses or ignores, and the model the body
names (no HTTP in here). A field of OpenAI's or vLLM's that this server does not implement is
refused with a 400 unless it asks for nothing (`UNSUPPORTED_CHAT_FIELDS`); one it does not know
(not in `KNOWN_CHAT_FIELDS`) is logged and the request goes on, as vLLM does. Chat's sets are the
base of legacy completions' and the Responses API's (`epd.gateway.completions_protocol`,
`epd.gateway.responses_protocol`). Every route that takes a body checks its model here
(`requested_model`; with `n` choices: `check_model`)."""

from __future__ import annotations

import json
import logging
from typing import Any

from epd.gateway.generation_options import GENERATION_OPTIONS
from epd.gateway.json_fields import checked_text, lax_value, shown_value
from epd.gateway.structured_request import STRUCTURED_FIELDS
from epd.model_runtime.sampling import MAX_CHOICES
from epd.stages.errors import InvalidRequest, NotFound

log = logging.getLogger(__name__)

UNSUPPORTED_CHAT_FIELDS = {
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    # vLLM's other ways to ask for a grammar (response_format, structured_outputs and guided_json,
    # guided_regex, guided_choice, guided_grammar are read: `epd.gateway.structured_request`).
    "guided_whitespace_pattern": (),
    # OpenAI's deprecated forms of tools and tool_choice: vLLM ignores them, which answered another
    # question than the one asked (send tools / tool_choice).
    "functions": ([],),
    "function_call": ("none", "auto"),
    "audio": (),
    "modalities": (["text"],),
    # vLLM's: they change the prompt, the frames or the text of the answer, so ignoring them
    # answered another question than the one asked (frames as vLLM samples them go in `media`).
    "add_special_tokens": (False,),
    "mm_processor_kwargs": ({},),
    "truncate_prompt_tokens": (),
    "documents": ([],),
    "logits_processors": ([],),
    "vllm_xargs": ({},),
    # vLLM's too, and logged as unknown fields: `media_io_kwargs` sets how vLLM loads a video
    # ({"video": {"num_frames": 16}}), the rest turn a model's thinking off (`enable_thinking` in
    # `chat_template_kwargs` does), bound it, end an answer early or mark it, or ask for the
    # rendered prompt back.
    "media_io_kwargs": ({},),
    "reasoning_effort": (),
    "thinking_token_budget": (),
    "repetition_detection": (),
    # The same in vLLM's earlier request (0 is off): ignoring them would let a repetition run on.
    "max_repetition_pattern_size": (0,),
    "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,),
    "watermarking": (False,),
    "return_prompt_text": (False,),
}
"""Fields of OpenAI's or vLLM's request that this server does not implement, with the values that
ask for nothing (null always does). Any other value is refused with a 400 that names the field,
rather than answered as if it had not been sent (vLLM honours most of them)."""

_FRAMES_GO_IN_MEDIA = 'frame sampling goes in "media": {"num_frames": 8} or {"fps": 2, "max_frames": 32}'

_INSTEAD = {
    "mm_processor_kwargs": _FRAMES_GO_IN_MEDIA,
    "media_io_kwargs": _FRAMES_GO_IN_MEDIA,
    "functions": 'send them as \'tools\': [{"type": "function", "function": {...}}]',
    "function_call": "send it as 'tool_choice'",
}
"""What to send instead of an unsupported field, where this server has another way to ask for it."""

KNOWN_CHAT_FIELDS = {
    "model", "messages", "stream", "stream_options", "n", "logprobs", "top_logprobs", "prompt_logprobs", "stop",
    "ignore_eos",
    "media", "pruning", "cache_salt", "user", "metadata", "store", "service_tier",
    "request_id", "logit_bias", "stop_token_ids", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
    "skip_special_tokens", "spaces_between_special_tokens",
    "return_token_ids",  # vLLM's: the choices' `token_ids` and the prompt's `prompt_token_ids`
    "include_reasoning",  # vLLM's: read with `--reasoning-parser` (`epd.gateway.reasoning`)
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template", "echo",
    *STRUCTURED_FIELDS,
    "tools", "tool_choice", "parallel_tool_calls",  # `epd.gateway.tool_request`
    *GENERATION_OPTIONS, *UNSUPPORTED_CHAT_FIELDS,
}  # fmt: skip
"""Every field of a chat request this server reads or refuses; others are ignored and logged, as vLLM
does."""


def refuse_unsupported_fields(body: dict, unsupported: dict[str, tuple], known: set[str]) -> None:
    """InvalidRequest for a field of `unsupported` (chat's: `UNSUPPORTED_CHAT_FIELDS`) set to
    anything but a value that asks for nothing; a field not in `known` is logged (the request goes on)."""
    for name, neutral in unsupported.items():
        value = body.get(name)
        if value is not None and not any(_asks_nothing(value, v) for v in neutral):
            raise InvalidRequest(
                f"'{name}' is not supported by this server; leave it unset"
                + (f" (or {json.dumps(neutral[0])})" if neutral else "")
                + (f"; {_INSTEAD[name]}" if name in _INSTEAD else "")
            )
    if unknown := sorted(str(name)[:64] for name in body if name not in known):
        log.warning("ignored request fields %s", unknown[:16])


def _asks_nothing(value: Any, neutral: Any) -> bool:
    """`value` is `neutral`, read as vLLM reads a field of the neutral value's type (best_of's
    "1" and 1.0 are its int 1, use_beam_search's "false" and 0 its bool false: `lax_value`);
    a string, list or object as it is."""
    if isinstance(neutral, (bool, int, float)):
        return lax_value(value, type(neutral)) == neutral
    return bool(value == neutral)


def requested_model(body: Any, served_model: str) -> str:
    """The body (a JSON object) names the served model, or none: the model's name, else
    InvalidRequest (400) or NotFound (404). Every route that takes a body and a model checks it."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = checked_text(body.get("model"), "model") or served_model
    if model != served_model:
        raise NotFound(f"model '{model[:200]}' is not served here; GET /v1/models lists '{served_model}'")
    return model


def check_model(body: Any, served_model: str) -> str:
    """`requested_model`, for an answer of `n` choices (1 to `MAX_CHOICES`, vLLM's and OpenAI's
    `n`): the model's name, else InvalidRequest (400) or NotFound (404)."""
    model = requested_model(body, served_model)
    n = body.get("n")
    if n is not None and not 1 <= (lax_value(n, int) or 0) <= MAX_CHOICES:
        raise InvalidRequest(
            f"'n' must be an integer from 1 to {MAX_CHOICES} (choices per request), got {shown_value(n)}; "
            "send more requests for more choices"
        )
    return model
