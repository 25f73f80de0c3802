"""OpenAI's legacy text completions JSON (`POST /v1/completions`) <-> the pipeline (no HTTP here).

The prompt is raw text, run as it is: no chat template, tokenised as the model's tokenizer
tokenises text by default (`tokenizer(prompt)`, its special tokens added), with the positions
`generate()` gives text (`epd.stages.raw_prompt`); or the prompt's token ids. One prompt per
request: `"prompt": "text"`, `["text"]`, `[1, 2, 3]` or `[[1, 2, 3]]`; a batch of several is
refused (400), as epd answers one prompt per call. The generation options, streaming,
`stream_options` and the server-side defaults are chat completions' (`epd.gateway.chat_request`);
`echo` (a token-id prompt's text is prefill's Detokenize of its ids, as vLLM's renderer decodes
them; with `max_tokens` 0 the prompt alone, vLLM's echo without generation), `logprobs`
(`epd.gateway.logprobs_protocol`; with `echo`, the prompt's tokens' logprobs come first, as
vLLM's; streamed, as vLLM's, each choice's first chunk is the prompt's text and its first step's,
with the prompt's tokens' logprobs then the step's) and
vLLM's `prompt_logprobs` are taken, `suffix` is refused. The answer is a `text_completion`
(streamed: `text_completion` chunks ending in `data: [DONE]`), each choice with vLLM's
`stop_reason` and `token_ids`, and the same `usage` and `epd` objects as chat's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from epd.gateway.ask_types import AskSummary
from epd.gateway.chat_request import ChatRequest, answer_options
from epd.gateway.json_fields import INT32_MAX, TOKEN_ID, boolean_field, checked_text, lax_value, number_item
from epd.gateway.logprobs_protocol import (
    completion_logprobs,
    completion_logprobs_option,
    prompt_logprobs_json,
)
from epd.gateway.request_fields import (
    KNOWN_CHAT_FIELDS,
    UNSUPPORTED_CHAT_FIELDS,
    check_model,
    refuse_unsupported_fields,
)
from epd.gateway.summary_fields import epd_details, usage
from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.errors import InvalidRequest
from epd.stages.raw_prompt import RawPrompt, check_raw_prompt
from epd.video.types import SamplingOptions

_COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED_CHAT_FIELDS,
    "add_special_tokens": (True,),  # vLLM's completions default: the tokenizer's special tokens added
    "suffix": ("",),
}
"""Chat's unsupported fields, but a raw prompt is tokenised with the tokenizer's special tokens;
OpenAI's `suffix` (text after the completion) is not implemented."""

_COMPLETION_KNOWN = (
    # The chat template's options are not vLLM's completions fields either (a raw prompt has no
    # template), nor is chat's top_logprobs (completions' logprobs is the count of alternatives):
    # logged as unknown, as vLLM ignores them.
    (
        KNOWN_CHAT_FIELDS
        - {
            "messages",
            "media",
            "pruning",
            "add_generation_prompt",
            "continue_final_message",
            "chat_template_kwargs",
            "chat_template",
            "top_logprobs",
        }
    )
    | {"prompt", "echo", *_COMPLETION_UNSUPPORTED}
)

_ONE_PROMPT = (
    "epd answers one prompt per request: send each prompt in a request of its own "
    '("prompt": "text", or a list of token ids)'
)


def parse_completion_request(
    body: Any, served_model: str, sampling_defaults: SamplingOptions, generation_defaults: GenerationConfig
) -> ChatRequest:
    """Validate a legacy completions body into the request chat's handler runs (no messages, a
    raw prompt); raises InvalidRequest (400) or NotFound (404, model)."""
    model = check_model(body, served_model)
    refuse_unsupported_fields(body, _COMPLETION_UNSUPPORTED, _COMPLETION_KNOWN)
    prompt = _prompt(body.get("prompt"))
    echo = boolean_field(body, "echo", False)
    # vLLM's echo without generation: max_tokens 0 answers the prompt alone; one token is generated
    # (the stages' least), as vLLM's, and its text left out (`ChatRequest.echo_only`).
    # max_tokens as vLLM reads it (0.0, "0" and false are 0 too), checked with the others below
    echo_only = echo and lax_value(body.get("max_tokens"), int) == 0
    if echo_only:
        body = {**body, "max_tokens": 1}
    logprobs = completion_logprobs_option(body)
    options = answer_options(body, model, generation_defaults, logprobs)
    generation: GenerationConfig = options["generation"]
    if echo and logprobs is not None:
        # vLLM's: the choice's logprobs list the prompt's tokens first, so echo asks for the
        # prompt's logprobs (prompt_logprobs, when unset, is logprobs); streamed, each choice's
        # first chunk carries them (`epd.gateway.ask_types.PromptLogprobs`).
        if generation.prompt_logprobs is None:
            options["generation"] = replace(generation, prompt_logprobs=logprobs)
    check_raw_prompt(prompt)
    return ChatRequest(
        messages=[],
        media_url="",
        modality="",
        sampling=sampling_defaults,
        raw_prompt=prompt,
        echo=echo,
        echo_only=echo_only,
        **options,
    )


def _prompt(value: Any) -> RawPrompt:
    """OpenAI's `prompt`: a string or a list of token ids, alone or as a list of one."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > 1:
            raise InvalidRequest(f"'prompt' holds {len(value)} prompts; {_ONE_PROMPT}")
        value = value[0]
    if isinstance(value, str):
        return RawPrompt(text=checked_text(value, "prompt"))
    # vLLM's `list[int]`, read as it reads an int (`lax_value`: 7.0 and true too); a list of strings
    # is a batch of prompts (above), as vLLM's union takes it.
    if isinstance(value, list) and all(lax_value(v, int) is not None for v in value):
        return RawPrompt(token_ids=tuple(number_item(v, TOKEN_ID, "prompt[]") for v in value))
    raise InvalidRequest(
        f"'prompt' must be a string or a list of token ids (integers from 0 to {INT32_MAX}); {_ONE_PROMPT}"
    )


# -- responses ----------------------------------------------------------------------------------


def text_completion_body(
    summary: AskSummary, request: ChatRequest, created: int | None = None
) -> dict[str, Any]:
    """The whole answer: its `text_completion` choices (the prompt's text first with `echo`)."""
    return {
        "id": f"cmpl-{summary.request_id}",
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": choice.index,
                "text": request.echoed_text + ("" if request.echo_only else choice.answer),
                "logprobs": None
                if choice.logprobs is None
                else completion_logprobs(
                    # vLLM's echo with logprobs: the prompt's tokens, then the answer's (none
                    # shown with max_tokens 0).
                    [*(summary.prompt_logprobs or ()), *([] if request.echo_only else choice.logprobs)]
                    if request.echo
                    else choice.logprobs
                ),
                "finish_reason": choice.finish_reason or "stop",
                "stop_reason": choice.stop_reason,
                # vLLM's, with its return_token_ids: the generated tokens' (echo_only's one too)
                "token_ids": choice.token_ids if request.return_token_ids else None,
                "prompt_logprobs": prompt_logprobs_json(summary.prompt_logprobs),  # vLLM's, when asked
                # vLLM's, each choice's (the one prompt's), with its return_token_ids
                "prompt_token_ids": summary.prompt_token_ids if request.return_token_ids else None,
            }
            for choice in summary.all_choices()
        ],
        "usage": usage(summary),
        "epd": epd_details(summary),
    }


def text_completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    stop_reason: StopReason = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed `text_completion` chunk of choice `index`; `token_ids` (extra) are the tokens
    its text came from (None, null: not asked), `logprobs` their `completion_logprobs` object when
    the request asked. vLLM writes every field of a completion's chunk: `prompt_token_ids` is
    null here, the prompt's ids on a choice's first chunk when asked (`ChatChunks`)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": None,
        "token_ids": token_ids,
    }
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
