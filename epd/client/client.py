"""gRPC clients of the front door: `AsyncEpdClient` (asyncio) and `EpdClient` (blocking).

    with EpdClient("127.0.0.1:50050", api_key="KEY") as client:
        result = client.ask("clip.mp4", "what colour is the circle?", max_new_tokens=16)
        print(result.answer, result.timings_ms.ttft_ms, result.pruning, result.grid_thw)

        # A conversation: parts in your order, rendered with the model's own chat template.
        result = client.ask("clip.mp4", messages=[Message.user("in this clip", VIDEO, "what moves?")])

        for event in client.stream("clip.mp4", "and the square?"):   # StageEvent | TokenDelta | AskResult
            if isinstance(event, StageEvent) and event.stage == Stage.VIDEO_DECODE:
                ...

        # Follow-ups that see the earlier answers (`epd.client.conversation`).
        chat = client.conversation("clip.mp4", num_frames=8)
        chat.ask("how many objects are there?")
        chat.ask("which appears first?")

One call = one `GatewayService.Ask` stream: a header, the media in 1 MiB chunks (or only its
sha256 when the servers have it), then stage events, the prompt's logprobs in pieces (when
asked: joined into `AskResult.prompt_logprobs`), token deltas and a summary come back.
Every call has a deadline (`timeout_s`, per client or per call, covering retries); UNAVAILABLE
is retried before the first token only (`retry.RetryPolicy`); failures raise `EpdError` with
the gRPC status, the server's message, and `retry_after_s` when the server was busy.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message as ProtoMessage

from epd.client.channel import MAX_MESSAGE_BYTES, ChannelSettings, channel_credentials, open_channel
from epd.client.conversation import AsyncConversation, Conversation
from epd.client.media import CHUNK_BYTES, Media, MediaSource
from epd.client.retry import RetryPolicy
from epd.client.types import (
    AskResult,
    EpdError,
    StageEvent,
    StreamEvent,
    TokenDelta,
    TokenizeResult,
    TokenLogprob,
    result_from_proto,
    stage_event_from_proto,
    tokenize_result_from_proto,
)
from epd.stages import template_kwargs, tools
from epd.stages.messages import IMAGE, VIDEO, ContentPart, Message, from_chat_template, media_type
from epd.transport.aio_cancel import cancelled_by_grpc, lost_while_sending
from epd.transport.message_convert import logprob_from_proto, logprobs_from_proto, messages_to_proto
from epd.transport.status_metadata import retry_after_in
from epd.transport.tracing import metadata_value
from epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, messages_pb2

__all__ = [
    "CHUNK_BYTES", "IMAGE", "VIDEO", "AskResult", "AsyncEpdClient", "ContentPart", "EpdClient", "EpdError",
    "Message", "StageEvent", "TokenDelta",
]  # fmt: skip

MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (64 << 10)
"""Largest `chunk_bytes`: room for the message's framing under gRPC's limit (larger chunks were
refused by the SDK's own channel, "Sent message larger than max")."""

MessageLike = Message | dict[str, Any]
"""A `Message`, or a dict in the processor's chat form (see `build_header`)."""


def conversation(messages: Sequence[MessageLike]) -> list[Message]:
    """`Message`s as they are; dicts through `epd.stages.messages.from_chat_template`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a list of Message objects or chat-form dicts")
    return [m if isinstance(m, Message) else from_chat_template([m])[0] for m in messages]


_SAMPLING_OPTIONS = (
    "fps",
    "max_frames",
    "min_frames",
    "num_frames",
    "start_time_s",
    "end_time_s",
    "max_pixels",
)
_GENERATION_OPTIONS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_p", "min_tokens", "logit_bias", "stop_token_ids",
    "include_stop_str_in_output", "allowed_token_ids", "bad_words", "skip_special_tokens",
    "spaces_between_special_tokens", "logprobs", "prompt_logprobs", "priority",
)  # fmt: skip
_GENERATION_PRESENT = (
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logprobs",
    "prompt_logprobs",
)
"""Options whose field has presence on the wire: sent when given, a zero or False included."""


def build_header(
    question: str | None,
    num_bytes: int,
    sha256: str,
    options: dict[str, Any],
    messages: Sequence[MessageLike] | None = None,
) -> gateway_pb2.AskHeader:
    """The AskHeader for a question or a conversation (exactly one) and `options` (the keyword
    options of `ask`); unknown names raise TypeError.

    messages: `Message`s, or dicts in the processor's chat form ({"role": "user", "content":
    [{"type": "video"}, {"type": "text", "text": ...}]}); parts keep their order. A question is
    the deprecated 0.1 form (kept until 0.3), the same as [Message.user(VIDEO, question)].
    Instead of both, the option `prompt`: a raw prompt (a string, or a list of token ids) run as
    it is, without the chat template, as OpenAI's legacy completions run one (no media with it).

    Sampling: fps, max_frames, min_frames, num_frames, start_time_s, end_time_s, max_pixels.
    Generation: max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, and vLLM's
    repetition_penalty, presence_penalty, frequency_penalty, min_p, min_tokens, logit_bias
    ({token id: bias}; ids as decimal strings too, as in an OpenAI body), stop_token_ids,
    include_stop_str_in_output, allowed_token_ids (a non-empty list of token ids), bad_words (a
    list of strings), skip_special_tokens and spaces_between_special_tokens (default True: the
    answer's text without the tokenizer's special tokens) (GenerationConfig's meanings);
    logprobs=k (0 to the server's --max-logprobs, 20 by default): each generated token's
    log-probability and the k most likely tokens' (`AskResult.logprobs`, `TokenDelta.logprobs`;
    raw model distribution, vLLM's default); prompt_logprobs=k (vLLM's, bounded alike): each
    prompt token's log-probability given the tokens before it, its rank and the k most likely
    tokens' there (`AskResult.prompt_logprobs`, sent in pieces before the first token; no
    streamed deltas carry them); structured outputs as vLLM's `structured_outputs`
    ({"json": schema}, {"json_object": True}, {"regex": "..."}, {"choice": [...]} or {"grammar":
    "EBNF"}, with "disable_any_whitespace") or OpenAI's `response_format` ({"type":
    "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema"}}).
    priority (vLLM's: lower is served earlier when the server runs --scheduling-policy priority;
    under fcfs, its default, anything but 0 is INVALID_ARGUMENT).
    Token dropping: pruning (a preset name), pruning_knobs ({name: value}). Also request_id, and
    cache_salt (vLLM's: requests share cached tokens and prefix KV only with the same salt and
    API key; at most 256 printable characters). The chat template's end, vLLM's:
    add_generation_prompt (default True: a new answer follows the last message) and
    continue_final_message (True, with add_generation_prompt=False and the assistant's message
    last: the model continues that message, and the answer is the continuation alone), and
    chat_template_kwargs (a dict of extra template variables, JSON values, such as
    {"enable_thinking": False}; those the model's template does not read are dropped),
    chat_template (a Jinja template's text that renders this request's prompt instead of the
    server's; INVALID_ARGUMENT unless its prefill runs with --trust-request-chat-template), and
    tools (OpenAI's function tools, [{"type": "function", "function": {"name", "description",
    "parameters"}}], rendered into the prompt as the template's `tools`; the answer is the model's
    text, its calls unparsed: the HTTP API parses them, and `epd ask --tools` with
    `epd.gateway.tool_parsers.answer.answer_tool_calls`). A conversation may hold an assistant's
    tool calls and tools' results: `Message("assistant", (text(""),), (ToolCall(id, name,
    arguments_json),))`, `Message("tool", (text(result),), tool_call_id=id)`, or OpenAI's dicts.
    Unset (None) values take the server's defaults; with no seed, each sampled request draws one.
    ValueError (`check_generation_options`): max_new_tokens < 1, top_p outside (0, 1] or
    repetition_penalty <= 0, which the wire cannot tell from unset; a negative or NaN temperature,
    a negative logprobs or prompt_logprobs; messages=[]. TypeError naming the option: a value of the wrong type
    (num_frames=2.5, stop=5). Other ranges are the server's to check (INVALID_ARGUMENT, naming
    the setting, as the HTTP API's 400).
    """
    options = dict(options)
    options["stop"] = _stop_strings(options.pop("stop", None))
    structured = _structured_outputs(
        options.pop("structured_outputs", None), options.pop("response_format", None)
    )
    if options.get("logit_bias") is not None:
        options["logit_bias"] = _logit_bias(options["logit_bias"])
    if isinstance(options.get("bad_words"), str):  # protobuf would send each of its characters as a word
        raise TypeError(
            f"bad_words must be a list of strings, such as ['red'], got {_shown(options['bad_words'])}"
        )
    sampling_given = {k: v for k in _SAMPLING_OPTIONS if (v := options.pop(k, None)) is not None}
    generation_given = {k: v for k in _GENERATION_OPTIONS if (v := options.pop(k, None)) is not None}
    # Types first (protobuf's own TypeError names neither the option nor what it takes), then ranges.
    _typed(common_pb2.VideoSampling, sampling_given)
    _typed(common_pb2.GenerationParams, generation_given)
    check_generation_options(generation_given)
    sampling = common_pb2.VideoSampling(**{k: v for k, v in sampling_given.items() if v})
    generation = common_pb2.GenerationParams(
        **{k: v for k, v in generation_given.items() if v or k in _GENERATION_PRESENT}
    )
    if structured is not None:
        generation.structured_outputs.CopyFrom(structured)
    for name, kind, what in (
        ("pruning", str, 'a preset name such as "balanced"'),
        ("request_id", str, "a string"),
        ("cache_salt", str, "a string"),
        ("pruning_knobs", Mapping, "a dict of knob names to values"),
    ):
        if options.get(name) is not None and not isinstance(options[name], kind):
            raise TypeError(f"{name} must be {what}, got {_shown(options[name])}")
    pruning = common_pb2.PruningOptions(
        preset=options.pop("pruning", "") or "",
        knobs={k: str(v) for k, v in (options.pop("pruning_knobs", None) or {}).items()},
    )
    request_id = options.pop("request_id", "") or ""
    cache_salt = options.pop("cache_salt", "") or ""
    prompt = _raw_prompt(options.pop("prompt", None))
    template = _template(
        options.pop("add_generation_prompt", None),
        options.pop("continue_final_message", None),
        options.pop("chat_template_kwargs", None),
        options.pop("chat_template", None),
        options.pop("tools", None),
    )
    if options:
        known = sorted(
            (
                *_SAMPLING_OPTIONS,
                *_GENERATION_OPTIONS,
                "pruning",
                "pruning_knobs",
                "request_id",
                "cache_salt",
                "prompt",
                "add_generation_prompt",
                "continue_final_message",
                "chat_template_kwargs",
                "chat_template",
                "tools",
            )
        )
        raise TypeError(f"unknown options: {sorted(options)}; known: {known}")
    if prompt is not None:
        if question is not None or messages is not None:
            raise TypeError("pass a prompt, a question or messages=[...], one of them, not both")
    elif (question is None) == (messages is None):
        raise TypeError("pass a question or messages=[...], not both (and not neither)")
    if messages is not None and not messages:
        raise ValueError(
            "messages is empty: send the conversation, ending with the user's message that holds the "
            "video (or image) and the question"
        )
    return gateway_pb2.AskHeader(
        request_id=request_id,
        question=question or "",
        messages=messages_to_proto(conversation(messages)) if messages is not None else [],
        media_num_bytes=num_bytes,
        media_sha256=sha256,
        sampling=sampling,
        generation=generation,
        pruning=pruning,
        cache_salt=cache_salt,
        prompt=prompt,
        template=template,
    )


def check_generation_options(options: Mapping[str, Any]) -> None:
    """ValueError, before any call, for a generation option (`build_header`'s names) whose value no
    server takes or the wire cannot tell from unset; None values are unset. Bounds only the server
    knows (its --max-logprobs, --max-new-tokens-limit, the vocabulary) are the server's to check."""
    # Zero is also "the server's default" on the wire (proto3 scalars have no presence; the seed
    # has): so a zero that would mean something else is refused here, not sent as the default.
    if (max_new := options.get("max_new_tokens")) is not None and max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (None: the server's default), got {max_new}")
    # A NaN passes `< 0` (every comparison with NaN is false).
    if (temperature := options.get("temperature")) is not None and not (
        math.isfinite(temperature) and temperature >= 0
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if (top_p := options.get("top_p")) is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (None: 1, all tokens), got {top_p}")
    if (penalty := options.get("repetition_penalty")) is not None and not penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0 (None: 1, off), got {penalty}")
    if (allowed := options.get("allowed_token_ids")) is not None and not len(allowed):
        raise ValueError("allowed_token_ids is empty, which allows no token (None: every token)")
    for name, zero in (
        ("logprobs", "the sampled token's alone"),
        ("prompt_logprobs", "each prompt token's own"),
    ):
        if (k := options.get(name)) is not None and k < 0:
            raise ValueError(
                f"{name} must be >= 0, the number of most likely tokens shown at each position (0: {zero}; "
                f"None: none), got {k}"
            )


def _template(
    add_generation_prompt: Any,
    continue_final_message: Any,
    chat_template_kwargs: Any,
    chat_template: Any = None,
    tool_list: Any = None,
) -> messages_pb2.ChatTemplateOptions | None:
    """The chat template options; None (unset on the wire) for the defaults. The server checks
    the pair (both true is INVALID_ARGUMENT, as the HTTP API's 400), the variables' names and
    sizes, the template's size and whether it takes one, and the tools
    (`epd.stages.tools.check_tools`)."""
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a Jinja template's text (a str), got {_shown(chat_template)}")
    tools_json = _json_option(
        "tools",
        tool_list,
        isinstance(tool_list, Sequence) and not isinstance(tool_list, (str, bytes)),
        "a list of function tools (dicts)",
        tools.to_json,
    )
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {_shown(value)}")
    kwargs_json = _json_option(
        "chat_template_kwargs",
        chat_template_kwargs,
        isinstance(chat_template_kwargs, Mapping),
        "a dict of variable names to values",
        template_kwargs.to_json,
    )
    if (
        add_generation_prompt is None
        and not continue_final_message
        and not kwargs_json
        and chat_template is None
        and not tools_json
    ):
        return None
    options = messages_pb2.ChatTemplateOptions(
        continue_final_message=bool(continue_final_message),
        chat_template_kwargs_json=kwargs_json,
        chat_template=chat_template,
        tools_json=tools_json,
    )
    if add_generation_prompt is not None:
        options.add_generation_prompt = add_generation_prompt
    return options


def _json_option(name: str, value: Any, fits: bool, what: str, to_json: Callable[[Any], str]) -> str:
    """A template option's JSON text for the wire ("" for None or an empty one); TypeError unless
    it `fits` (is `what`) and holds JSON values."""
    if value is None:
        return ""
    if not fits:
        raise TypeError(f"{name} must be {what}, got {_shown(value)}")
    if not value:
        return ""
    try:
        return to_json(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{name} must hold JSON values (None, bools, numbers, str, lists, dicts): {exc}"
        ) from None


def _raw_prompt(prompt: Any) -> messages_pb2.RawPrompt | None:
    """The `prompt` option (a raw prompt, run without the chat template as OpenAI's legacy
    completions run one): its text, or its token ids; None: the request has none."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return messages_pb2.RawPrompt(text=prompt)
    if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return messages_pb2.RawPrompt(token_ids=prompt)
    raise TypeError(f"prompt must be a string or a list of token ids, got {_shown(prompt)}")


def _stop_strings(stop: Any) -> list[str]:
    """`stop` as the HTTP API takes it: a string or a list of strings (None: none). An empty
    string is sent as one, for the server to refuse as the HTTP API does (it was dropped)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise TypeError(f"stop must be a string or a list of strings, got {_shown(stop)}")


def _logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias}; ids may be decimal strings too, as in an OpenAI request body (JSON keys)."""
    if not isinstance(bias, Mapping):
        raise TypeError(
            f"logit_bias must be a dict of token ids to biases, such as {{1734: -100}}, got {_shown(bias)}"
        )
    out = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isascii() and token.isdecimal():
            token = int(token)
        if not isinstance(token, int) or isinstance(token, bool):
            raise TypeError(
                f"logit_bias keys must be token ids (int, or a decimal string), got {_shown(token)}"
            )
        out[token] = value
    return out


_KINDS = {
    FieldDescriptor.CPPTYPE_INT32: ("an integer", "integers"), FieldDescriptor.CPPTYPE_INT64: ("an integer", "integers"),
    FieldDescriptor.CPPTYPE_DOUBLE: ("a number", "numbers"), FieldDescriptor.CPPTYPE_BOOL: ("True or False", "bools"),
    FieldDescriptor.CPPTYPE_STRING: ("a string", "strings"),
}  # fmt: skip
"""(one, many) of a wire type, for the errors of `_typed`."""


def _structured_outputs(structured: Any, response_format: Any) -> common_pb2.StructuredOutputs | None:
    """The structured-output options as the HTTP API reads them (ValueError with its message), or
    a `StructuredOutputs` as it is (`epd ask`'s flags)."""
    from dataclasses import asdict

    from epd.gateway.structured_request import parse_structured_outputs
    from epd.model_runtime.sampling import StructuredOutputs
    from epd.stages.errors import InvalidRequest

    if isinstance(structured, StructuredOutputs) and response_format is None:
        return common_pb2.StructuredOutputs(**asdict(structured))
    try:
        spec = parse_structured_outputs(
            {"structured_outputs": structured, "response_format": response_format}
        )
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    return None if spec is None else common_pb2.StructuredOutputs(**asdict(spec))


def _typed(message: type[ProtoMessage], given: dict[str, Any]) -> None:
    """TypeError naming the option whose value the wire `message` cannot hold and what it takes
    (ValueError for an integer past its 32 or 64 bits): protobuf's own errors ("bad argument
    type for built-in operation") name neither."""
    for name, value in given.items():
        try:
            message(**{name: value})
        except (TypeError, ValueError) as exc:
            field_ = message.DESCRIPTOR.fields_by_name[name]
            if field_.message_type is not None:  # a map (logit_bias)
                key, item = (field_.message_type.fields_by_name[f].cpp_type for f in ("key", "value"))
                what = f"a dict of {_KINDS[key][1]} to {_KINDS[item][1]}"
            else:
                what = (
                    f"a list of {_KINDS[field_.cpp_type][1]}"
                    if field_.is_repeated
                    else _KINDS[field_.cpp_type][0]
                )
            if isinstance(exc, UnicodeError):  # a lone surrogate: no UTF-8 for it
                raise ValueError(
                    f"{name} must be {what} of valid Unicode (no lone surrogates), got {_shown(value)}"
                ) from None
            if isinstance(exc, ValueError):
                bits = 32 if field_.cpp_type == FieldDescriptor.CPPTYPE_INT32 else 64
                raise ValueError(
                    f"{name} must be {what} of at most {bits} bits (signed), got {_shown(value)}"
                ) from None
            raise TypeError(f"{name} must be {what}, got {_shown(value)}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def tokenize_request(
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    add_special_tokens: bool | None,
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
    return_token_strs: bool,
    request_id: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
    tool_list: Sequence[Mapping[str, Any]] | None = None,
) -> gateway_pb2.GatewayServiceTokenizeRequest:
    """The request of `tokenize` (see there); TypeError for a value of the wrong type, or for
    both or neither of prompt and messages, ValueError for messages=[]. The server checks the
    rest (INVALID_ARGUMENT, as the HTTP API's 400)."""
    if (prompt is None) == (messages is None):
        raise TypeError("pass a prompt (a string) or messages=[...] (a conversation), one of them")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {_shown(prompt)}")
    if messages is not None and not messages:
        raise ValueError("messages is empty: send the conversation to tokenize")
    for name, value in (("add_special_tokens", add_special_tokens), ("return_token_strs", return_token_strs)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {_shown(value)}")
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {_shown(request_id)}")
    return gateway_pb2.GatewayServiceTokenizeRequest(
        request_id=request_id,
        prompt=prompt,
        messages=messages_to_proto(conversation(messages)) if messages is not None else [],
        add_special_tokens=add_special_tokens,
        template=_template(
            add_generation_prompt, continue_final_message, chat_template_kwargs, chat_template, tool_list
        ),
        return_token_strs=return_token_strs,
    )


def _check_options(options: dict[str, Any]) -> None:
    """Raise TypeError on an unknown option now rather than at a conversation's first turn."""
    build_header(None, 0, "", {k: v for k, v in options.items() if k != "timeout_s"},
                 [Message.user(VIDEO, "?")])  # fmt: skip


async def _join_prompt_logprobs(joined: list[TokenLogprob], piece: common_pb2.PromptLogprobs) -> None:
    """`piece`'s entries made `TokenLogprob`s at the end of `joined`, the result's one list (the
    public `AskResult.prompt_logprobs` is a list: made once, entry by entry, no list of the piece's
    beside it), on a worker thread: a piece is about 50,000 entries, 0.3 s of Python, which on the
    client's event loop would stall every other call's stream that long (a blocking `EpdClient`'s
    calls share one loop too; docs/benchmarks.md, "Prompt logprobs on the event loop")."""
    await asyncio.to_thread(joined.extend, map(logprob_from_proto, piece.logprobs))


class AsyncEpdClient:
    """asyncio client; use `async with AsyncEpdClient(endpoint) as client:`. It may also be made
    before the event loop runs (`client = AsyncEpdClient(...)`, then `asyncio.run(main())`): its
    channel opens at the first call, in that call's loop, and serves that loop only.

    endpoint: "HOST:PORT" of the gateway. timeout_s: default deadline of one call (retries
    included). api_key: sent as `authorization: Bearer ...`. tls / root_certificates_path /
    server_name_override: a TLS channel; client_certificate_path / client_key_path: the
    certificate it presents to a gateway that requires one (mTLS). retry: when UNAVAILABLE is
    tried again.
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 600.0,
        *,
        api_key: str = "",
        tls: bool = False,
        root_certificates_path: str = "",
        server_name_override: str = "",
        client_certificate_path: str = "",
        client_key_path: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
        retry: RetryPolicy | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(
                f"timeout_s must be a positive number of seconds (every call has a deadline), got {timeout_s!r}"
            )
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be from 1 to {MAX_CHUNK_BYTES} (a chunk and its message framing fit "
                f"the {MAX_MESSAGE_BYTES >> 20} MiB gRPC message limit), got {chunk_bytes}"
            )
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.chunk_bytes = chunk_bytes
        self.settings = ChannelSettings(
            tls,
            root_certificates_path,
            server_name_override,
            api_key,
            tuple(metadata),
            client_certificate_path,
            client_key_path,
        )
        self._credentials = channel_credentials(self.settings)
        # Opened by the first call, in its event loop: grpc.aio binds a channel to the loop running
        # when it is made, and a client made before `asyncio.run(main())` (no loop yet, or
        # another) failed every call with "got Future attached to a different loop".
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _stub(self) -> gateway_pb2_grpc.GatewayServiceStub:
        loop = asyncio.get_running_loop()
        if self._channel is None:
            self._channel, self._loop = (
                open_channel(self.endpoint, self.settings, self.retry, self._credentials),
                loop,
            )
        elif loop is not self._loop:
            raise RuntimeError(
                "this AsyncEpdClient made its calls in another event loop, and its channel belongs "
                "to that loop; make one client per event loop (e.g. inside the asyncio.run coroutine)"
            )
        return gateway_pb2_grpc.GatewayServiceStub(self._channel)

    async def ask_stream(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AsyncGenerator[gateway_pb2.AskResponse, None]:
        """Deprecated (removed in 0.3): the raw AskResponse protos (events, token deltas, then
        the summary). Use `stream`, which yields the same as typed SDK objects."""
        warnings.warn(
            "ask_stream is deprecated (removed in 0.3); use stream()", DeprecationWarning, stacklevel=2
        )
        async with aclosing(
            self._responses(video, question, messages, media_sha256, timeout_s, options)
        ) as msgs:
            async for msg, _ in msgs:
                yield msg

    async def stream(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Yields `StageEvent`s and `TokenDelta`s as they happen, then one `AskResult`.

        video: a path, bytes or binary file object; None with `media_sha256` to reuse media the
        servers have seen (NOT_FOUND when they have not); None without it for a text-only
        conversation (the question alone, or messages without a media part: no encoder call, as
        vLLM answers text on a vision-language model). Options: see `build_header`.
        Leaving early (`aclose()`, or `async with contextlib.aclosing(...)` around a loop that
        breaks) cancels the call on the server."""
        events: list[StageEvent] = []
        prompt_logprobs: list[TokenLogprob] = []
        pieces_attempt = 0
        # aclosing: when this generator is closed early, the call is cancelled now (`_responses`'s
        # finally), not whenever the garbage collector gets to the inner generator.
        async with aclosing(
            self._responses(video, question, messages, media_sha256, timeout_s, options)
        ) as msgs:
            async for msg, meta in msgs:
                kind = msg.WhichOneof("kind")
                if kind == "prompt_logprobs":  # in pieces, before the first delta; kept for the result
                    if meta[0] != pieces_attempt:  # a retried call sends them all again
                        prompt_logprobs, pieces_attempt = [], meta[0]
                    await _join_prompt_logprobs(prompt_logprobs, msg.prompt_logprobs)
                elif kind == "event":
                    event = stage_event_from_proto(msg.event)
                    events.append(event)
                    yield event
                elif kind == "delta":
                    yield TokenDelta(
                        list(msg.delta.token_ids), msg.delta.text, logprobs_from_proto(msg.delta.logprobs)
                    )
                elif kind == "summary":
                    result = result_from_proto(msg.summary, events, prompt_logprobs or None)
                    result.num_attempts, result.media_num_bytes_sent = meta
                    yield result
                    return
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    async def ask(
        self,
        video: Media | None,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        media_sha256: str = "",
        timeout_s: float | None = None,
        **options,
    ) -> AskResult:
        """The whole answer at once (see `stream` for the options)."""
        items = self.stream(video, question, messages=messages, media_sha256=media_sha256, timeout_s=timeout_s,
                            **options)  # fmt: skip
        async with aclosing(items):  # a cancelled `ask` cancels its call now
            async for item in items:
                if isinstance(item, AskResult):
                    return item
        raise EpdError(grpc.StatusCode.INTERNAL, "the stream ended without a summary")

    def conversation(self, video: Media | None, *, system: str = "", **options) -> AsyncConversation:
        """A conversation about `video` (None: about text alone): each `await conv.ask(question)` sends the history (the
        video and first question, the earlier answers, then the new question) and appends its
        answer. `options` are `ask`'s (`timeout_s` included), for every turn; `system`: an
        optional system message first. See `epd.client.conversation`.

            chat = client.conversation("clip.mp4", num_frames=8)
            first = await chat.ask("how many objects are there?")
            second = await chat.ask("which appears first?")
        """
        _check_options(options)
        return AsyncConversation(self, video, system=system, **options)

    async def upload_or_reuse(
        self,
        video: Media,
        question: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        timeout_s: float | None = None,
        **options,
    ) -> AskResult:
        """Ask by the video's sha256 first (no upload); on NOT_FOUND upload the bytes.

        Saves the upload when the encoder still caches this video with these sampling options;
        `result.media_num_bytes_sent` says which happened."""
        source = MediaSource(video, self.chunk_bytes)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        try:
            return await self.ask(
                None, question, messages=messages, media_sha256=source.sha256, timeout_s=timeout_s, **options
            )
        except EpdError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
        return await self.ask(
            source, question, messages=messages, timeout_s=max(0.0, deadline - time.monotonic()), **options
        )

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        return_token_strs: bool = False,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> TokenizeResult:
        """The token ids of a text, or of a text-only conversation rendered with the model's chat
        template exactly as `ask(None, messages=...)` renders its prompt (the HTTP API's
        /tokenize, vLLM's): `GatewayService.Tokenize`.

        prompt: a text, tokenised as it is; or messages: `Message`s or chat-form dicts without a
        video or image part (INVALID_ARGUMENT: their tokens depend on the frames sampled), ending
        with any role's message. add_special_tokens: None is vLLM's default (True for a prompt,
        False for messages). add_generation_prompt / continue_final_message /
        chat_template_kwargs / chat_template / tools: as `ask`'s (the default ends with the opening of a new answer, so
        `num_tokens` is that ask's `num_prompt_tokens`); messages only (INVALID_ARGUMENT with a
        prompt, as `ask(None, prompt=...)`). return_token_strs: also the tokenizer's token of each id."""
        request = tokenize_request(
            prompt,
            messages,
            add_special_tokens,
            add_generation_prompt,
            continue_final_message,
            return_token_strs,
            request_id,
            chat_template_kwargs,
            chat_template,
            tools,
        )
        answer = await self._unary("Tokenize", request, timeout_s)
        return tokenize_result_from_proto(answer, return_token_strs)

    async def detokenize(
        self, token_ids: Sequence[int], *, request_id: str = "", timeout_s: float | None = None
    ) -> str:
        """The text of token ids of the served model's vocabulary, special tokens kept (the HTTP
        API's /detokenize): `GatewayService.Detokenize`. INVALID_ARGUMENT for an id outside the
        vocabulary, or more than 262,144 ids."""
        if isinstance(token_ids, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise TypeError(f"token_ids must be a list of token ids (integers), got {_shown(token_ids)}")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {_shown(request_id)}")
        _typed(gateway_pb2.GatewayServiceDetokenizeRequest, {"token_ids": list(token_ids)})  # 32 bits each
        request = gateway_pb2.GatewayServiceDetokenizeRequest(request_id=request_id, token_ids=token_ids)
        return (await self._unary("Detokenize", request, timeout_s)).text

    async def _responses(
        self,
        video: Media | None,
        question: str | None,
        messages: Sequence[MessageLike] | None,
        media_sha256: str,
        timeout_s: float | None,
        options: dict[str, Any],
    ) -> AsyncGenerator[tuple[gateway_pb2.AskResponse, tuple[int, int]], None]:
        """The call with its retries; yields (message, (attempt number, media bytes sent))."""
        source = None
        if video is not None:
            source = MediaSource(video, self.chunk_bytes)
        elif not media_sha256:
            if question is not None:  # no media: the question alone, a text-only conversation
                messages = [Message.user(question)]
                question = None
            elif messages is not None and media_type(conversation(messages)):
                raise ValueError(
                    "the messages have a video or image part: pass the video (path, bytes or file object) "
                    "or the media_sha256 of one the server has"
                )
        header = build_header(
            question,
            source.num_bytes if source else 0,
            source.sha256 if source else media_sha256,
            options,
            messages,
        )
        if (num_bytes := header.ByteSize()) > MAX_MESSAGE_BYTES:
            # gRPC would refuse to send it with its own words ("Sent message larger than max
            # (5000022 vs. 4194304)"), naming neither the conversation nor what to change.
            raise EpdError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request's conversation and settings are {num_bytes} bytes, over the "
                f"{MAX_MESSAGE_BYTES >> 20} MiB one gRPC message may carry; send a shorter conversation",
            )
        timeout_s_used = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + timeout_s_used
        attempt = 0
        while True:
            attempt += 1
            saw_token = False
            call = None
            try:
                call = self._stub().Ask(
                    _requests(header, source),
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self.settings.call_metadata(),
                )
                async for msg in call:
                    saw_token = saw_token or msg.WhichOneof("kind") == "delta"
                    yield msg, (attempt, source.num_bytes if source else 0)
                return
            except grpc.aio.AioRpcError as exc:
                error = _call_error(exc, deadline, timeout_s_used, "or ask for fewer tokens or frames")
            except asyncio.CancelledError:
                if not cancelled_by_grpc():
                    raise  # our caller cancelled this call
                # grpc.aio's own cancel: the request could not be written (epd.transport.aio_cancel).
                late = _past(deadline)
                error = EpdError(
                    grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED,
                    "the deadline passed before the request was sent; raise timeout_s"
                    if late
                    else "gRPC cancelled the call: its request could not be sent (did reading the media fail?)",
                )
            finally:
                # A consumer that stops reading (a `break`, `aclose()`, its task cancelled) leaves
                # this generator at the yield: grpc.aio would go on receiving the answer, and the
                # servers go on generating it, until it completes. Cancelling ends it there now.
                if call is not None and not call.done():
                    call.cancel()
            await self._before_retry(error, attempt, saw_token, deadline)

    async def _before_retry(self, error: EpdError, attempt: int, saw_token: bool, deadline: float) -> None:
        """Wait before trying the call again, or raise `error` when the retry policy (or the
        deadline) says not to."""
        wait_s = max(self.retry.backoff_s(attempt), error.retry_after_s or 0)
        busy = error.retry_after_s is not None
        if (
            not self.retry.should_retry(error.code, attempt, saw_token, busy)
            or time.monotonic() + wait_s >= deadline
        ):
            raise error from None
        await asyncio.sleep(wait_s)

    async def _unary(self, method: str, request: ProtoMessage, timeout_s: float | None) -> Any:
        """One unary call of the gateway, retried as `ask` is before its first token."""
        timeout_s_used = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + timeout_s_used
        attempt = 0
        while True:
            attempt += 1
            try:
                return await getattr(self._stub(), method)(
                    request,
                    timeout=max(0.0, deadline - time.monotonic()),
                    metadata=self.settings.call_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                error = _call_error(exc, deadline, timeout_s_used)
            await self._before_retry(error, attempt, False, deadline)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def __aenter__(self) -> AsyncEpdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _call_error(
    exc: grpc.aio.AioRpcError, deadline: float, timeout_s_used: float, also_helps: str = ""
) -> EpdError:
    """The SDK's error for a failed call: the server's status and message, gRPC's own words for
    a send cut short or our deadline replaced by what to change (`also_helps`: what else does, for
    this call, after "raise timeout_s")."""
    code, message = exc.code(), exc.details() or ""
    request_id = metadata_value(exc.trailing_metadata())
    exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED  # the mark means "busy" on it only
    retry_after_s = retry_after_in(exc.trailing_metadata()) if exhausted else None
    if lost_while_sending(code, message):
        # grpc.aio's own INTERNAL for a send the call's end cut short: by the deadline, or by a
        # connection that broke (the server is gone: retried as UNAVAILABLE).
        code, message = (
            (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the deadline passed while the request was being sent; raise timeout_s",
            )
            if _past(deadline)
            else (grpc.StatusCode.UNAVAILABLE, "the connection broke while the request was being sent")
        )
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and _past(deadline):
        # Our own deadline (gRPC's text: "Deadline Exceeded"), not a server's message.
        message = f"no answer within the call's deadline ({timeout_s_used:g} s, timeout_s); raise timeout_s"
        if also_helps:
            message += f", {also_helps}"
    return EpdError(code, message, retry_after_s, request_id)


DEADLINE_CLOCK_SLACK_S = 0.005
"""gRPC times a call's deadline on its own clock, from a moment just after ours: an error its
deadline caused may reach us a hair before `deadline` by our clock."""


def _past(deadline: float) -> bool:
    return time.monotonic() >= deadline - DEADLINE_CLOCK_SLACK_S


async def _requests(header: gateway_pb2.AskHeader, source: MediaSource | None):
    yield gateway_pb2.AskRequest(header=header)
    if source is not None:
        for chunk in source.chunks():
            yield gateway_pb2.AskRequest(media_chunk=chunk)


class EpdClient:
    """Blocking client with the same methods and arguments. It runs an `AsyncEpdClient` on a
    private event loop in its own thread, so it also works where a loop is already running
    (Jupyter, other async frameworks' threads).

    `close()` when done (or `with`). A client dropped without it is closed when it is garbage
    collected (its channel, sockets and thread), with a ResourceWarning as Python gives for an
    unclosed file (shown under `python -X dev` or `-W default`); one still open at interpreter exit
    is closed then, likewise. Both by its `weakref.finalize` (`_close_dropped`), which holds what it
    closes (`_ClientParts`), never the client. Its thread is a daemon, which cannot run once the
    interpreter finalizes: a stream left half read was closed only then, by its generator's
    finalizer, which waited forever for the loop to cancel the call (the script hung at exit);
    finalizers run at exit before that, while the thread still runs."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0, **settings) -> None:
        loop = asyncio.new_event_loop()
        self._parts = _ClientParts(
            loop, threading.Thread(target=_run_loop, args=(loop,), name="epd-client", daemon=True)
        )
        self._parts.thread.start()
        try:
            self._client: AsyncEpdClient = self._run(_make(endpoint, timeout_s, settings))
        except BaseException:
            # No one can close a client that was never made: each failed construction (a missing
            # certificate file, a bad option) would leave its thread and loop running.
            self._parts.closed = True
            _stop_loop(self._parts)
            raise
        self._parts.client = self._client
        self._finalizer = weakref.finalize(self, _close_dropped, self._parts)

    def _run(self, coro):
        if self._parts.closed:
            coro.close()  # never to be awaited: closed now, or Python warns about it later
            raise RuntimeError("the client is closed; make a new EpdClient")
        return asyncio.run_coroutine_threadsafe(coro, self._parts.loop).result()

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    def ask(self, video: Media | None, question: str | None = None, **options) -> AskResult:
        """See `AsyncEpdClient.ask`; `messages=[...]` instead of a question for a conversation."""
        return self._run(self._client.ask(video, question, **options))

    def conversation(self, video: Media | None, *, system: str = "", **options) -> Conversation:
        """A conversation about `video` (see `AsyncEpdClient.conversation`):

        chat = client.conversation("clip.mp4", num_frames=8)
        print(chat.ask("how many objects are there?").answer)
        print(chat.ask("which appears first?").answer)   # sees the first answer
        """
        return Conversation(self, self._client.conversation(video, system=system, **options))

    def upload_or_reuse(self, video: Media, question: str | None = None, **options) -> AskResult:
        return self._run(self._client.upload_or_reuse(video, question, **options))

    def tokenize(self, prompt: str | None = None, **options) -> TokenizeResult:
        """See `AsyncEpdClient.tokenize`: `tokenize("text")` or `tokenize(messages=[...])`."""
        return self._run(self._client.tokenize(prompt, **options))

    def detokenize(self, token_ids: Sequence[int], **options) -> str:
        """See `AsyncEpdClient.detokenize`."""
        return self._run(self._client.detokenize(token_ids, **options))

    def stream(self, video: Media | None, question: str | None = None, **options) -> Iterator[StreamEvent]:
        """Yields `StageEvent`s and `TokenDelta`s as they arrive, then one `AskResult`."""
        return self._iterate(self._client.stream(video, question, **options))

    def ask_stream(
        self, video: Media | None, question: str | None = None, **options
    ) -> Iterator[gateway_pb2.AskResponse]:
        """Deprecated (removed in 0.3): raw protos; use `stream`."""
        return self._iterate(self._client.ask_stream(video, question, **options))

    def _iterate(self, agen: AsyncGenerator) -> Iterator:
        if self._parts.closed:  # before the generator starts on a loop that is gone
            raise RuntimeError("the client is closed; make a new EpdClient")
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Breaking out early cancels the call on the server (the async generators close
            # theirs in turn, down to `_responses`). A client closed meanwhile cancelled it already.
            if not self._parts.closed:
                self._run(agen.aclose())

    def close(self) -> None:
        """Close the channel (a call in flight ends with CANCELLED) and the streams left open, then
        stop the client's thread. Idempotent."""
        if self._finalizer.detach() is not None:  # closed here: nothing left for the finalizer, no warning
            _close(self._parts)

    def __enter__(self) -> EpdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _end_other_tasks() -> None:
    """Cancel every task on the running loop but this one, and wait for them to end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make(endpoint: str, timeout_s: float, settings: dict[str, Any]) -> AsyncEpdClient:
    return AsyncEpdClient(endpoint, timeout_s, **settings)  # grpc.aio channels bind to the running loop


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The client thread: its loop until stopped, then closed there (a client collected on this very
    thread cannot wait for that: `_close`)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


@dataclass
class _ClientParts:
    """What an EpdClient holds that must be closed: what its finalizer takes, as it may not hold the client."""

    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    client: AsyncEpdClient | None = None
    closed: bool = False
    """Set as closing starts: a call made from then on is refused, not queued on a stopped loop."""


async def _wind_down(client: AsyncEpdClient) -> None:
    await client.close()
    # A stream left half read: its async generators are closed now, on the loop, rather than by the
    # garbage collector later, when the loop is gone ("Event loop is closed").
    await asyncio.get_running_loop().shutdown_asyncgens()
    # What grpc.aio still has running for a call the closed channel ended (its status handler waits
    # one more turn of the loop): cancelled and awaited, as `asyncio.run` ends its tasks, not
    # destroyed pending when the loop closes ("Task was destroyed but it is pending!").
    await _end_other_tasks()


def _close(parts: _ClientParts) -> None:
    """Close the channel and the streams left open, then stop the loop and its thread."""
    parts.closed = True
    assert parts.client is not None
    if threading.current_thread() is parts.thread:
        # Collected on its own loop's thread (a cycle the collector found there): waiting for the
        # loop here would wait for itself; the loop winds down on its own, then stops and closes.
        parts.loop.create_task(_wind_down(parts.client)).add_done_callback(lambda _: parts.loop.stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(_wind_down(parts.client), parts.loop).result()
    finally:
        _stop_loop(parts)


def _stop_loop(parts: _ClientParts) -> None:
    parts.loop.call_soon_threadsafe(parts.loop.stop)
    parts.thread.join()  # `_run_loop` closes the loop as it ends


def _close_dropped(parts: _ClientParts) -> None:
    """An EpdClient's finalizer: it was garbage collected, or the interpreter exits, unclosed."""
    assert parts.client is not None
    warnings.warn(
        f"unclosed EpdClient for {parts.client.endpoint}: close() it, or use `with EpdClient(...) as client:`",
        ResourceWarning,
        stacklevel=1,  # the collector or the exit calls this: no caller of the user's to point at
    )
    _close(parts)
