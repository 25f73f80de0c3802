"""OpenAI chat-completions JSON <-> the pipeline's request and results (no HTTP in here).

A request is a conversation: system, user, assistant and tool messages (earlier turns are
history), the last one the user's (or a tool's result), whose content is a string or a list of `text`, `video_url` and
`image_url` parts. The parts keep the client's order: [text, video_url] is rendered text first,
exactly as the model's chat template renders it (`epd.stages.messages`). At most one `video_url`
or `image_url` part per request, in a user message; with none, the conversation is text alone
(vLLM's answer to a health check's "ping" or a title request: no encoder call, and "media" and
"pruning" are checked but have nothing to act on, as vLLM ignores its multimodal options
without media; `kv_dtype` still narrows the KV cache). Generation options are OpenAI's own fields (max_completion_tokens or
max_tokens, temperature, top_p, seed, stop, presence_penalty, frequency_penalty, logit_bias,
response_format; logprobs and top_logprobs: `epd.gateway.logprobs_protocol`) plus
vLLM's `top_k`, `ignore_eos`, `repetition_penalty`, `min_p`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`,
`spaces_between_special_tokens`, `priority` and structured outputs (`structured_outputs`, `guided_json` ...:
`epd.gateway.structured_request`), with vLLM's meanings; the chat template's variables go in vLLM's
`chat_template_kwargs` (`{"enable_thinking": false}`) beside its `add_generation_prompt` and
`continue_final_message`; vLLM's `include_reasoning` (false: the reasoning left out of a thinking
model's answer, which `--reasoning-parser` parts: `epd.gateway.reasoning`); OpenAI's `tools` and
`tool_choice` (`epd.gateway.tool_request`; the answer's calls: `epd.gateway.tool_parsers`), with an
assistant's `tool_calls` and `tool` messages in the conversation; frame sampling goes in
one extra object, `"media": {"fps", "max_frames", "min_frames", "num_frames", "max_pixels",
"start_time_s", "end_time_s"}` (with the openai client: `extra_body={"media": {...}}`), and token
dropping in `"pruning": {"preset": "balanced", "knobs": {"kv_keep_ratio": 0.25}}`.
Fields left out take the server's defaults, which are greedy: unlike OpenAI, a missing
`temperature` means 0. A field of OpenAI's or vLLM's that this server does not implement is
refused with a 400 unless it asks for nothing (`UNSUPPORTED_CHAT_FIELDS`); one it does not know is logged.
vLLM's `add_generation_prompt` and `continue_final_message` say how the chat template ends the
prompt, and its `echo` puts the last message's text in front of the answer when that message's
role is the answer's (with `continue_final_message`: the whole assistant message comes back).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from epd.gateway.ask_types import AskSummary, ChoiceSummary
from epd.gateway.json_fields import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    TOKEN_ID,
    NumberRange,
    boolean_field,
    check_collection,
    checked_text,
    lax_int,
    number_field,
    number_item,
    shown_value,
)
from epd.gateway.logprobs_protocol import (
    chat_logprobs,
    chat_logprobs_option,
    prompt_logprobs_json,
    prompt_logprobs_option,
)
from epd.gateway.reasoning import MarkerIds, PartedAnswers, message_fields, part_answers
from epd.gateway.structured_request import STRUCTURED_FIELDS, parse_structured_outputs
from epd.gateway.tool_parsers.answer import answer_tool_calls, tool_finish_reason
from epd.gateway.tool_request import ToolChoice, forced_structured_outputs, parse_tools
from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.logprobs import TokenLogprob
from epd.model_runtime.sampling import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    GenerationConfig,
    check_bad_words,
    check_stop_strings,
)
from epd.stages.chat_template import check_request_chat_template
from epd.stages.contracts import TokenStep, check_cache_salt
from epd.stages.errors import Busy, InvalidRequest, NotFound
from epd.stages.messages import (
    ROLES,
    ChatTemplateOptions,
    ContentPart,
    Message,
    check_messages,
    tool_calls_from_chat,
)
from epd.stages.messages import text as text_part
from epd.stages.names import timings_with_legacy_names
from epd.stages.raw_prompt import RawPrompt
from epd.stages.scheduling import PRIORITY_MAX, PRIORITY_MIN
from epd.stages.template_kwargs import check_chat_template_kwargs
from epd.token_pruning import PruningConfig
from epd.transport.convert import MAX_SAMPLING_FPS, pruning_from_proto
from epd.transport.errors import status_of
from epd.v1 import common_pb2
from epd.video.types import ONE_FRAME_CHOICE, SamplingOptions

log = logging.getLogger(__name__)

# gRPC status (from epd.transport.errors.status_of) -> HTTP status and OpenAI error type.
_HTTP_OF_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    # The model cannot be loaded (`ModelLoadError`): the server's to fix, not the request's; vLLM
    # answers a request to an engine that failed with 500 too.
    grpc.StatusCode.FAILED_PRECONDITION: (500, "server_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (413, "request_too_large"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.ABORTED: (502, "server_error"),  # a stage failed mid-answer (after its first token)
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

_MEDIA_OPTIONS = {
    "fps": NumberRange(float, 0.0, MAX_SAMPLING_FPS, low_open=True),
    "max_frames": NumberRange(int, 1, INT32_MAX),
    "min_frames": NumberRange(int, 1, INT32_MAX),
    "num_frames": NumberRange(int, 1, INT32_MAX),
    "max_pixels": NumberRange(int, 1, INT64_MAX),
    "start_time_s": NumberRange(float, 0.0, math.inf),
    "end_time_s": NumberRange(float, 0.0, math.inf, low_open=True),
}
_GENERATION_OPTIONS = {
    "max_completion_tokens": NumberRange(int, 1, INT32_MAX),
    "max_tokens": NumberRange(int, 1, INT32_MAX),
    "temperature": NumberRange(float, 0.0, math.inf),
    "top_p": NumberRange(float, 0.0, 1.0, low_open=True),
    "top_k": NumberRange(int, -1, INT32_MAX),  # -1 (vLLM's) and 0: off
    "seed": NumberRange(int, INT64_MIN, INT64_MAX),
    "repetition_penalty": NumberRange(float, 0.0, math.inf, low_open=True),
    "presence_penalty": NumberRange(float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "frequency_penalty": NumberRange(float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "min_p": NumberRange(float, 0.0, 1.0),
    "min_tokens": NumberRange(int, 0, INT32_MAX),
    # vLLM's: lower is served earlier under --scheduling-policy priority; under fcfs only 0 is taken
    # (the pipeline's check against prefill's policy: `Pipeline._check_priority`).
    "priority": NumberRange(int, PRIORITY_MIN, PRIORITY_MAX),
}
_LOGIT_BIAS = NumberRange(float, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)

UNSUPPORTED_CHAT_FIELDS = {
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
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
    "return_token_ids",  # vLLM's: the choices' `token_ids` (not its `prompt_token_ids`)
    "include_reasoning",  # vLLM's: read with `--reasoning-parser` (`epd.gateway.reasoning`)
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template", "echo",
    *STRUCTURED_FIELDS,
    "tools", "tool_choice", "parallel_tool_calls",  # `epd.gateway.tool_request`
    *_GENERATION_OPTIONS, *UNSUPPORTED_CHAT_FIELDS,
}  # fmt: skip
"""Every field of a chat request this server reads or refuses; others are ignored and logged, as vLLM
does."""


def http_status_of(code: grpc.StatusCode) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) of a gRPC status code."""
    return _HTTP_OF_STATUS.get(code, (500, "server_error"))


def http_error_of(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, client-safe message) of any exception. A refusal for
    load (`Busy`: the front door's admission, or a stage's full queue or KV budget passed on with
    its retry mark) is a 429 to retry; every other limit is a 413."""
    if isinstance(exc, Busy) or getattr(exc, "retry_after_s", None):
        return 429, "rate_limit_error", str(exc)
    code, message = status_of(exc)
    status, error_type = http_status_of(code)
    # An error of the HTTP layer's own may name a status gRPC has no code for (408: the client's
    # body came too slowly, where DEADLINE_EXCEEDED alone would say 504, an upstream's delay).
    return getattr(exc, "http_status", status), error_type, message


def error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    """vLLM's error object: `code` is the HTTP status as an integer, in a response and in an error
    event of a stream alike (which has answered 200 already: the code says what it would be)."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


@dataclass
class ChatRequest:
    """What one chat-completions body (or a legacy completions body: `raw_prompt`; or a Responses
    API body: `responses`) asks for, in the pipeline's terms."""

    model: str
    messages: list[Message]
    """The conversation in the client's part order; its media part, if any, is `media_url`'s place."""
    media_url: str
    """"" when the conversation has no media part (text alone: the encoder is not called)."""
    modality: str  # "video" | "image": which content part carried the URL; "" without one
    sampling: SamplingOptions
    generation: GenerationConfig
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): the usage so far on
    every chunk, not only in the final one."""
    pruning: PruningConfig = PruningConfig()
    cache_salt: str = ""
    """vLLM's `cache_salt`: requests share cached visual tokens and prefix KV only when their salts
    (and API keys) are equal."""
    request_id: str = ""
    """vLLM's `request_id`: the request's id unless an `x-request-id` header names one
    (`epd.transport.tracing.adopt_request_id`, as the gRPC API's `AskHeader.request_id`)."""
    raw_prompt: RawPrompt | None = None
    """A legacy completions request's prompt (`epd.gateway.completions_protocol`), run without
    the chat template; `messages` is empty then, and the answer is a `text_completion`."""
    echo: bool = False
    """`echo`, vLLM's meanings: a legacy completion's text begins with its prompt's text; a chat
    answer's content begins with the last message's, when that message's role is the answer's
    (`echoed_text`)."""
    prompt_ids_text: str = ""
    """The text of a legacy completion's token-id prompt, set by the front door (prefill's
    Detokenize, special tokens kept, as vLLM's renderer decodes such a prompt) only when `echo`
    needs it: the gateway holds no tokenizer."""
    echo_only: bool = False
    """A legacy completion's `echo` with `max_tokens` 0, vLLM's echo without generation: the answer
    is the prompt alone, with its logprobs when asked (how lm-evaluation-harness scores a text's
    loglikelihood). As vLLM's, one token is generated (`usage` counts it, `token_ids` lists it)
    and its text left out."""
    template: ChatTemplateOptions = ChatTemplateOptions()
    """vLLM's `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`: how
    the chat template renders the prompt. A continued message's answer is the continuation alone,
    as vLLM's; with `echo` too, it is the whole message, the given text first."""
    return_token_ids: bool = False
    """vLLM's `return_token_ids`: each choice lists its generated tokens' ids (`token_ids`), whole
    or streamed (each chunk its step's); left out otherwise, as vLLM's. Not the prompt's ids
    (vLLM's `prompt_token_ids`): the gateway does not hold them (prefill tokenises)."""
    include_reasoning: bool = True
    """vLLM's `include_reasoning`: false leaves a thinking model's reasoning out of the answer
    (with `--reasoning-parser`; without one the answer is the text whole, as vLLM's)."""
    tool_choice: ToolChoice = ToolChoice()
    """OpenAI's `tool_choice` over the request's tools (`template.tools`): whether the answer's
    text is parsed for calls (`epd.gateway.tool_parsers`) or forced to them
    (`epd.gateway.tool_request`)."""
    responses: dict[str, Any] | None = None
    """A Responses API request's fields its answer repeats (`epd.gateway.responses_protocol`);
    None for a chat or legacy completions request."""

    @property
    def response_role(self) -> str:
        """The answer's role, as vLLM's: the assistant's, or without a generation prompt the last
        message's (the message the model continues, or the turn it writes on in)."""
        if self.template.add_generation_prompt or not self.messages:
            return "assistant"
        return self.messages[-1].role

    @property
    def echoed_text(self) -> str:
        """What `echo` puts in front of the generated text ("" without it): a raw prompt's text
        (`prompt_ids_text` for token ids), or, as vLLM's chat echo, the last message's text when
        its role is the answer's (the assistant's message continued with `continue_final_message`,
        an assistant's message followed by a new answer, or without a generation prompt the
        message the model writes on in). Its text parts are joined with "\n" as vLLM joins them (a template may render
        them otherwise: Qwen's concatenates them); a media part in it is refused at parsing
        (`_check_echo`). Not the answer's tokens: usage counts the generated ones alone."""
        if not self.echo:
            return ""
        if self.raw_prompt is not None:
            return self.raw_prompt.text or self.prompt_ids_text
        if not self.messages or self.messages[-1].role != self.response_role:
            return ""
        return "\n".join(p.text for p in self.messages[-1].parts if p.type == "text")


def template_options(body: Any) -> ChatTemplateOptions:
    """vLLM's `add_generation_prompt` (default true), `continue_final_message` (default false),
    `chat_template_kwargs` (default none) and `chat_template` (default the server's) of a chat or
    /tokenize body; the variables and the template's size are checked here, the pair with the
    messages (`ChatTemplateOptions.check`). Prefill, which renders, refuses a template unless it
    trusts request templates (vLLM's --trust-request-chat-template)."""
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    check_chat_template_kwargs(kwargs)
    chat_template = body.get("chat_template")
    check_request_chat_template(chat_template)
    return ChatTemplateOptions(
        add_generation_prompt=boolean_field(body, "add_generation_prompt", True),
        continue_final_message=boolean_field(body, "continue_final_message", False),
        chat_template_kwargs=kwargs,
        chat_template=chat_template,
    )


def parse_chat_request(
    body: Any, served_model: str, sampling_defaults: SamplingOptions, generation_defaults: GenerationConfig
) -> ChatRequest:
    """Validate a chat-completions body; raises InvalidRequest (400) or NotFound (404, model)."""
    model = check_model(body, served_model)
    refuse_unsupported_fields(body, UNSUPPORTED_CHAT_FIELDS, KNOWN_CHAT_FIELDS)
    messages, media_url, modality = parse_messages(body.get("messages"))
    options = answer_options(body, model, generation_defaults, chat_logprobs_option(body))
    tools, tool_choice = parse_tools(body)
    generation = options.pop("generation")
    structured = forced_structured_outputs(tools, tool_choice, generation.structured_outputs)
    request = ChatRequest(
        messages=messages,
        media_url=media_url,
        modality=modality,
        sampling=_sampling(body.get("media"), sampling_defaults),
        pruning=_pruning(body.get("pruning")),
        template=replace(template_options(body), tools=tools),
        echo=boolean_field(body, "echo", False),
        include_reasoning=boolean_field(body, "include_reasoning", True),
        tool_choice=tool_choice,
        generation=replace(generation, structured_outputs=structured),
        **options,
    )
    # The message model's own rules (the last message is the user's or the assistant's, ...).
    check_messages(messages, template=request.template)
    _check_echo(request)
    return request


def _check_echo(request: ChatRequest) -> None:
    """InvalidRequest when `echo` would put a message with a media part in front of the answer:
    a video or image has no text to echo (vLLM echoes the model's placeholder text, or fails, by
    the template's content format), and echoing its text parts alone would not be the message
    sent. It only arises without a generation prompt and with the user's message (the one media
    part's place) last."""
    if not request.echo or request.messages[-1].role != request.response_role:
        return
    if media := next((p.type for p in request.messages[-1].parts if p.is_media), None):
        raise InvalidRequest(
            f"'echo' puts the last message's content in front of the answer, but the last message holds a "
            f"{media}, which has no text to echo: leave 'echo' unset or false (the answer is then the "
            "generated text alone)"
        )


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
    if n is not None and not 1 <= (lax_int(n) or 0) <= MAX_CHOICES:
        raise InvalidRequest(
            f"'n' must be an integer from 1 to {MAX_CHOICES} (choices per request), got {shown_value(n)}; "
            "send more requests for more choices"
        )
    return model


def answer_options(
    body: dict, model: str, generation_defaults: GenerationConfig, logprobs: int | None = None
) -> dict[str, Any]:
    """The fields chat and legacy completions share, as `ChatRequest` keyword arguments: streaming
    and its usage options, generation (with `logprobs`, each door's own field:
    `epd.gateway.logprobs_protocol`), cache_salt, request_id, return_token_ids."""
    stream = boolean_field(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise InvalidRequest('stream_options only goes with "stream": true')  # as vLLM
    stream_options = stream_options or {}
    if not isinstance(stream_options, dict):
        raise InvalidRequest("stream_options must be an object")
    include_usage = boolean_field(stream_options, "include_usage", False, "stream_options.include_usage")
    return {
        "model": model,
        "generation": replace(
            _generation(body, generation_defaults),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs_option(body, stream),
        ),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": include_usage
        and boolean_field(
            stream_options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats"
        ),
        "cache_salt": check_cache_salt(checked_text(body.get("cache_salt"), "cache_salt")),
        "request_id": checked_text(body.get("request_id"), "request_id"),
        "return_token_ids": boolean_field(body, "return_token_ids", False),
    }


def refuse_unsupported_fields(body: dict, unsupported: dict[str, tuple], known: set[str]) -> None:
    """InvalidRequest for a field of `unsupported` (chat's: `UNSUPPORTED_CHAT_FIELDS`) set to
    anything but a value that asks for nothing; a field not in `known` is logged (the request goes on)."""
    for name, neutral in unsupported.items():
        value = body.get(name)
        # Equal and both bools or neither (False == 0 in Python; 0 == 0.0 is meant).
        if value is not None and not any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral
        ):
            raise InvalidRequest(
                f"'{name}' is not supported by this server; leave it unset"
                + (f" (or {json.dumps(neutral[0])})" if neutral else "")
                + (f"; {_INSTEAD[name]}" if name in _INSTEAD else "")
            )
    if unknown := sorted(str(name)[:64] for name in body if name not in known):
        log.warning("ignored request fields %s", unknown[:16])


def _pruning(value: Any) -> PruningConfig:
    """{"preset": name, "knobs": {name: value}} -> PruningConfig, parsed as the gRPC path does."""
    if value is None:
        return PruningConfig()
    if not isinstance(value, dict) or set(value) - {"preset", "knobs"}:
        raise InvalidRequest('\'pruning\' must be an object like {"preset": "balanced", "knobs": {...}}')
    knobs = value.get("knobs") or {}
    if not isinstance(knobs, dict):
        raise InvalidRequest("pruning.knobs must be an object of knob names to values")
    preset = value.get("preset") or "off"
    if not isinstance(preset, str):
        raise InvalidRequest('pruning.preset must be a string such as "balanced"')
    text_knobs = {}
    for name, knob in knobs.items():
        if isinstance(knob, (dict, list)):
            raise InvalidRequest(
                f"pruning.knobs.{checked_text(name, 'pruning.knobs')[:64]} must be a number, string or bool"
            )
        text = str(knob).lower() if isinstance(knob, bool) else str(knob)
        text_knobs[checked_text(name, "pruning.knobs")] = checked_text(text, f"pruning.knobs.{name[:64]}")
    options = common_pb2.PruningOptions(preset=checked_text(preset, "pruning.preset"), knobs=text_knobs)
    return pruning_from_proto(options)


def parse_messages(messages: Any) -> tuple[list[Message], str, str]:
    """OpenAI messages -> (the conversation, the media URL, "video" | "image"). Roles system, user,
    assistant and tool; content a string or a list of text / video_url / image_url parts (or the
    other spellings vLLM reads: `_TEXT_PARTS`, input_image, a media part without "type"), kept in the
    client's order; at most one media part, in a user message (none: text alone, URL and kind ""),
    and the last message the user's, a tool's or the assistant's. An assistant's `tool_calls`
    (content null) and a tool's `tool_call_id` are kept for the template; the deprecated
    `function_call` is refused, not dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    # OpenAI's newer name of the system role (its models take developer messages in its place).
    roles = [
        _ROLE_ALIASES.get(r, r) if isinstance(r := m.get("role") if isinstance(m, dict) else None, str) else r
        for m in messages
    ]
    if any(r not in ROLES for r in roles):
        shown = [r[:32] if isinstance(r, str) else None for r in roles[:8]]
        raise InvalidRequest(
            f"message roles must be {', '.join(ROLES)} (got roles {shown}{'...' if len(roles) > 8 else ''})"
        )
    out: list[Message] = []
    media: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if message.get(
            "function_call"
        ):  # the deprecated form of a turn's call: its content alone is not what was said
            raise InvalidRequest(
                f"messages[{i}] has 'function_call', OpenAI's deprecated form of a call; send it as "
                '\'tool_calls\': [{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}]'
            )
        tool_calls = tool_calls_from_chat(message.get("tool_calls"), i)
        for j, call in enumerate(tool_calls):  # text the wire can carry (no lone surrogate)
            for value, what in (
                (call.id, "id"),
                (call.name, "function.name"),
                (call.arguments, "function.arguments"),
            ):
                checked_text(value, f"messages[{i}].tool_calls[{j}].{what}")
        tool_call_id = message.get("tool_call_id") if roles[i] == "tool" else None
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise InvalidRequest(
                f"messages[{i}].tool_call_id must be a string, the id of the call it answers"
            )
        content = message.get("content")
        if content is None and roles[i] == "assistant":  # OpenAI's own history: a turn of tool calls alone
            content = ""
        as_string = isinstance(content, str)  # a text's refusal names the content, or its part's text
        if as_string:
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list) or not content:
            raise InvalidRequest(
                f"messages[{i}].content must be a string or a non-empty list of content parts"
            )
        parts: list[ContentPart] = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is None and isinstance(part, dict):  # vLLM's media part without "type"
                kind = next((key for key in ("video_url", "image_url") if key in part), None)
            if isinstance(kind, str) and (text_key := _TEXT_PARTS.get(kind)) is not None:
                if not isinstance(part.get(text_key), str):
                    raise InvalidRequest(
                        f"a {kind} part of messages[{i}] needs its text: {{'type': '{kind}', '{text_key}': '...'}}"
                    )
                name = f"messages[{i}].content" + ("" if as_string else f"[{k}].{text_key}")
                parts.append(text_part(checked_text(part[text_key], name)))
            elif kind in ("video_url", "image_url", "input_image"):
                if roles[i] != "user":
                    raise InvalidRequest(
                        f"messages[{i}] is a {roles[i]} message; put the {kind} part in a user message"
                    )
                # the Responses API's input_image holds its URL as image_url, as vLLM's chat reads it
                kind = "image_url" if kind == "input_image" else kind
                ref = part.get(kind)
                url = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(url, str) or not url:
                    raise InvalidRequest(f"a {kind} part needs {{'{kind}': {{'url': ...}}}}")
                if not url.startswith("data:"):  # a data: URL is checked as it is decoded (ASCII only)
                    checked_text(url, f"{kind}.url")
                media.append((url, kind.removesuffix("_url")))
                parts.append(ContentPart(kind.removesuffix("_url")))
            else:
                kind_text = (
                    kind[:64] if isinstance(kind, str) else kind if kind is None else type(kind).__name__
                )
                raise InvalidRequest(
                    f"unsupported content part {kind_text!r}; use 'text', 'video_url' or 'image_url'"
                )
        out.append(
            Message(str(roles[i]), tuple(parts), tool_calls, checked_text(tool_call_id, "tool_call_id"))
        )
    if len(media) > 1:
        raise InvalidRequest(
            f"the messages have {len(media)} video_url / image_url parts; at most one video or image per "
            "request is supported (the encoder encodes one media per request): send one"
        )
    if not media:  # a text-only conversation, as vLLM answers one on a vision-language model
        return out, "", ""
    return out, media[0][0], media[0][1]


_ROLE_ALIASES = {"developer": "system"}

_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""The text parts vLLM's chat reads (`_parse_chat_message_content_mm_part` in
vllm/entrypoints/chat_utils.py), by type: the field that holds the text. The Responses API's
input_text / output_text come from clients that build chat messages from Responses items, and an
assistant's refusal part from OpenAI's own history."""


def _sampling(media: Any, defaults: SamplingOptions) -> SamplingOptions:
    if media is None:
        return defaults
    if not isinstance(media, dict):
        raise InvalidRequest(
            '\'media\' must be an object such as {"num_frames": 8} or {"fps": 2, "max_frames": 32}'
        )
    unknown = sorted(str(name)[:64] for name in set(media) - set(_MEDIA_OPTIONS))
    if unknown:
        raise InvalidRequest(f"unknown media options {unknown[:8]}; known: {sorted(_MEDIA_OPTIONS)}")
    v = {name: number_field(media, name, spec, None) for name, spec in _MEDIA_OPTIONS.items()}
    if v["fps"] is not None and v["num_frames"] is not None:
        raise InvalidRequest(f"'media': fps and num_frames: {ONE_FRAME_CHOICE}")
    if v["fps"] is not None:  # the request's rate, not the server's --num-frames
        defaults = replace(defaults, num_frames=None)
    max_frames = v["max_frames"] if v["max_frames"] is not None else defaults.max_frames
    return replace(
        defaults,
        fps=v["fps"] if v["fps"] is not None else defaults.fps,
        max_frames=max_frames,
        min_frames=v["min_frames"] if v["min_frames"] is not None else min(defaults.min_frames, max_frames),
        num_frames=v["num_frames"] if v["num_frames"] is not None else defaults.num_frames,
        max_pixels=v["max_pixels"] if v["max_pixels"] is not None else defaults.max_pixels,
        start_time_s=v["start_time_s"] if v["start_time_s"] is not None else defaults.start_time_s,
        end_time_s=v["end_time_s"] if v["end_time_s"] is not None else defaults.end_time_s,
    )


def _generation(body: dict, defaults: GenerationConfig) -> GenerationConfig:
    v = {name: number_field(body, name, spec, None) for name, spec in _GENERATION_OPTIONS.items()}
    max_tokens = v["max_completion_tokens"] if v["max_completion_tokens"] is not None else v["max_tokens"]
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = defaults.stop
    elif isinstance(stop, str):
        stops = (checked_text(stop, "stop"),)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(checked_text(s, "stop") for s in stop)
    else:
        raise InvalidRequest("'stop' must be a string or a list of strings")
    try:
        check_stop_strings(stops)
    except ValueError as exc:
        raise InvalidRequest(f"'stop': {exc}") from None

    def given(name: str, default: Any) -> Any:
        return v[name] if v[name] is not None else default

    return GenerationConfig(
        max_new_tokens=max_tokens if max_tokens is not None else defaults.max_new_tokens,
        temperature=given("temperature", defaults.temperature),
        top_p=given("top_p", defaults.top_p),
        top_k=max(0, given("top_k", defaults.top_k)),
        seed=given("seed", defaults.seed),
        stop=stops,
        ignore_eos=boolean_field(body, "ignore_eos", defaults.ignore_eos),
        repetition_penalty=given("repetition_penalty", defaults.repetition_penalty),
        presence_penalty=given("presence_penalty", defaults.presence_penalty),
        frequency_penalty=given("frequency_penalty", defaults.frequency_penalty),
        min_p=given("min_p", defaults.min_p),
        min_tokens=given("min_tokens", defaults.min_tokens),
        logit_bias=_logit_bias(body.get("logit_bias"), defaults.logit_bias),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids"), defaults.stop_token_ids),
        include_stop_str_in_output=boolean_field(
            body, "include_stop_str_in_output", defaults.include_stop_str_in_output
        ),
        allowed_token_ids=_allowed_token_ids(body.get("allowed_token_ids"), defaults.allowed_token_ids),
        bad_words=_bad_words(body.get("bad_words"), defaults.bad_words),
        # the default: fitted to the context after the prompt, as vLLM's
        fit_max_new_tokens=max_tokens is None,
        priority=given("priority", defaults.priority),
        skip_special_tokens=boolean_field(body, "skip_special_tokens", defaults.skip_special_tokens),
        spaces_between_special_tokens=boolean_field(
            body, "spaces_between_special_tokens", defaults.spaces_between_special_tokens
        ),
        n=lax_int(body.get("n")) or defaults.n,  # checked by `check_model`
        structured_outputs=parse_structured_outputs(body),
    )


def _logit_bias(value: Any, default: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> (id, bias) pairs, by id."""
    if value is None:
        return default
    check_collection(
        value,
        dict,
        "logit_bias",
        'an object of token ids to biases, such as {"1734": -100}',
        MAX_LOGIT_BIAS_ENTRIES,
    )
    pairs = {}
    for key, bias in value.items():
        token = (
            int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10 else -1
        )
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids ({TOKEN_ID.describe()}), got {shown_value(key)}"
            )
        pairs[token] = number_item(bias, _LOGIT_BIAS, f"logit_bias[{token}]")
    return tuple(sorted(pairs.items()))


def _stop_token_ids(value: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    check_collection(value, list, "stop_token_ids", "a list of token ids", MAX_STOP_TOKEN_IDS)
    return tuple(number_item(v, TOKEN_ID, "stop_token_ids[]") for v in value)


def _allowed_token_ids(value: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    check_collection(value, list, "allowed_token_ids", "a list of token ids", MAX_ALLOWED_TOKEN_IDS)
    if not value:  # vLLM's 400 too: no token could be generated
        raise InvalidRequest(
            "'allowed_token_ids' is empty, which allows no token; leave it out (or null) for all"
        )
    return tuple(number_item(v, TOKEN_ID, "allowed_token_ids[]") for v in value)


def _bad_words(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    check_collection(value, list, "bad_words", 'a list of strings, such as ["red", "blue"]', MAX_BAD_WORDS)
    if not all(isinstance(w, str) for w in value):
        raise InvalidRequest('\'bad_words\' must be a list of strings, such as ["red", "blue"]')
    words = tuple(checked_text(w, "bad_words") for w in value)
    try:
        check_bad_words(words)
    except ValueError as exc:
        raise InvalidRequest(f"'bad_words': {exc}") from None
    return words


# -- responses ----------------------------------------------------------------------------------


def usage(summary: AskSummary, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` are the prompt tokens whose KV came
    from prefill's prefix cache (as OpenAI and vLLM report prompt caching). The prompt counts once
    and the completion tokens are every choice's (as vLLM's, for n choices). `reasoning_tokens`
    (every choice's, `epd.gateway.reasoning.part_answers`; None without
    `--reasoning-parser`) goes in `completion_tokens_details`, as vLLM's chat reports it only with
    a reasoning parser."""
    completion = sum(len(choice.token_ids) for choice in summary.all_choices())
    body: dict[str, Any] = {
        "prompt_tokens": summary.num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": summary.num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": summary.num_reused_prompt_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def epd_details(summary: AskSummary) -> dict[str, Any]:
    """Extra `epd` field: the whole summary, under the names the gRPC summary and the SDK's
    `AskResult` use (the answer itself is the message content), and `kept_tokens`, the kept
    visual tokens as a grid for the web demo. `timings_ms` also carries "decode", the old name
    of "video_decode", until 0.3."""
    return {
        "request_id": summary.request_id,
        "token_ids": summary.token_ids,
        "finish_reason": summary.finish_reason or "stop",
        "stop_reason": summary.stop_reason,
        "num_frames": summary.num_frames,
        "num_visual_tokens": summary.num_visual_tokens,
        "num_prompt_tokens": summary.num_prompt_tokens,
        "num_reused_prompt_tokens": summary.num_reused_prompt_tokens,
        "frame_timestamps_s": summary.frame_timestamps_s,
        "timings_ms": timings_with_legacy_names(summary.timings_ms),
        "kv_num_bytes": summary.kv_num_bytes,
        "encoder_cache_hit": summary.encoder_cache_hit,
        "media_sha256": summary.media_sha256,
        "pruning": summary.pruning.to_dict(),
        "grid_thw": list(summary.grid_thw),
        "kept_visual_token_index": summary.kept_visual_token_index,
        **({"kept_tokens": kept_token_grid(summary)} if summary.kept_visual_token_index else {}),
    }


def kept_token_grid(summary: AskSummary, merge_size: int = 2) -> list[list[list[int]]]:
    """kept[t][row][col] (0/1) over the merged-token grid of each temporal group: which visual
    tokens reached the KV cache. grid_thw is in patches; a merged token covers merge x merge."""
    t, h, w = summary.grid_thw
    rows, cols = h // merge_size, w // merge_size
    kept = [[[0] * cols for _ in range(rows)] for _ in range(t)]
    for index in summary.kept_visual_token_index:
        group, rest = divmod(index, rows * cols)
        if group < t:
            kept[group][rest // cols][rest % cols] = 1
    return kept


def shows_token_ids(return_token_ids: bool, thinking: bool | None, include_reasoning: bool) -> bool:
    """Whether a chat answer's choices (whole or streamed) list their token ids: when the request
    sets vLLM's `return_token_ids`, unless the reasoning is left out (`include_reasoning` false
    under a reasoning parser: `thinking` not None), whose ids would show it, as vLLM hides them
    (its chat serving code's `hide_stream_metadata`)."""
    return return_token_ids and (thinking is None or include_reasoning)


def completion_body(
    summary: AskSummary,
    model: str,
    created: int | None = None,
    role: str = "assistant",
    echoed: str = "",
    thinking: bool | None = None,
    include_reasoning: bool = True,
    tool_choice: ToolChoice = ToolChoice(),
    steps: Iterable[TokenStep] | None = None,
    marker_ids: MarkerIds | None = None,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """A chat answer's body; `role`: `ChatRequest.response_role`; `echoed`: `ChatRequest.echoed_text`,
    the content's start (usage still counts the generated tokens alone, as vLLM's). `thinking`
    (with `--reasoning-parser`: `epd.gateway.reasoning.thinking_on`; None without one) parts each
    choice's text, from the answer's token `steps` (needed then), into the message's reasoning and
    content, counting the reasoning's tokens in the same pass (`part_answers`, as the Responses
    answer parts and counts its steps; by token id with the served model's `marker_ids`);
    `tool_choice` (`ChatRequest.tool_choice`) takes the content's tool calls into the message's
    `tool_calls` (`epd.gateway.tool_parsers`); `return_token_ids` (`ChatRequest`'s) lists each
    choice's token ids (`shows_token_ids`)."""
    parted = None
    if thinking is not None:
        if steps is None:
            raise ValueError("a reasoning parser parts the answer from its token steps: pass them")
        parted = part_answers(((s.index, s.text, s.token_ids) for s in steps), thinking, marker_ids)
    choices = []
    for choice in summary.all_choices():
        message, num_calls = _message(role, echoed, choice, parted, include_reasoning, tool_choice)
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": None if choice.logprobs is None else chat_logprobs(choice.logprobs),
                "finish_reason": tool_finish_reason(tool_choice, num_calls, choice.finish_reason or "stop"),
                "stop_reason": choice.stop_reason,
                **(
                    {"token_ids": choice.token_ids}
                    if shows_token_ids(return_token_ids, thinking, include_reasoning)
                    else {}
                ),
            }
        )
    return {
        "id": f"chatcmpl-{summary.request_id}",
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(summary, None if parted is None else parted.num_reasoning_tokens),
        # vLLM's: None for the first prompt token, then each token's (only when asked).
        "prompt_logprobs": prompt_logprobs_json(summary.prompt_logprobs),
        "epd": epd_details(summary),
    }


def _message(
    role: str,
    echoed: str,
    choice: ChoiceSummary,
    parted: PartedAnswers | None,
    include_reasoning: bool,
    tool_choice: ToolChoice,
) -> tuple[dict[str, Any], int]:
    """A choice's message and the number of its tool calls: its text whole, or as the reasoning
    parser parted it (`parted`), its content's tool calls taken out under the request's tool choice
    (`answer_tool_calls`), then an echo put in front of the content (as vLLM's: the calls are the
    generated text's, as the stream, which sends the echo in a chunk of its own, reads them)."""
    if parted is None:
        content: str | None = choice.answer
        fields: dict[str, Any] = {}
    else:
        split = parted.split(choice.index)
        content = split.content
        fields = message_fields(split, include_reasoning)
    content, calls = answer_tool_calls(content, tool_choice)
    if echoed:
        content = echoed + (content or "")
    if calls:
        fields["tool_calls"] = [call.to_json() for call in calls]
    return {"role": role, "content": content, **fields}, len(calls)


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    token_ids: list[int] | None = None,
    stop_reason: StopReason = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One `chat.completion.chunk` of choice `index`; `token_ids` (extra) are the tokens this chunk's
    text came from, `logprobs` theirs when the request asked; `stop_reason` (vLLM's) is set on the
    chunk with the finish reason."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else chat_logprobs(logprobs),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
