"""The requests the SDK sends, built from the caller's options and checked before any call (no
I/O): `build_header` (the AskHeader of `ask` and `stream`, and the options of a conversation's
every turn, `check_options`), `tokenize_request` and `detokenize_request`. A value of the wrong
type raises TypeError naming the option and what it takes, one the wire cannot tell from unset
ValueError (`check_generation_options`, which `epd ask` runs on its flags too); other ranges are
the server's to check (INVALID_ARGUMENT, as the HTTP API's 400)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message as ProtoMessage

from epd.stages import template_kwargs, tools
from epd.stages.messages import VIDEO, Message, from_chat_template
from epd.transport.message_convert import messages_to_proto
from epd.v1 import common_pb2, gateway_pb2, messages_pb2

__all__ = [
    "MessageLike", "build_header", "check_generation_options", "check_options", "conversation",
    "detokenize_request", "tokenize_request",
]  # fmt: skip

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
    "spaces_between_special_tokens", "logprobs", "prompt_logprobs", "priority", "return_prompt_token_ids",
)  # fmt: skip
_GENERATION_PRESENT = (
    "temperature",  # unset: the gateway's default (the model's, --generation-config); 0 is greedy
    "top_k",
    "min_p",
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
    streamed deltas carry them); return_prompt_token_ids=True (vLLM's return_token_ids, its
    prompt half): the prompt's token ids as the server's prefill ran it
    (`AskResult.prompt_token_ids`); structured outputs as vLLM's `structured_outputs`
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

    if isinstance(structured, StructuredOutputs):
        if response_format is None:
            return common_pb2.StructuredOutputs(**asdict(structured))
        structured = _as_http_fields(structured)  # merged with response_format as the HTTP API does
    try:
        spec = parse_structured_outputs(
            {"structured_outputs": structured, "response_format": response_format}
        )
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None
    return None if spec is None else common_pb2.StructuredOutputs(**asdict(spec))


def _as_http_fields(spec: Any) -> dict[str, Any]:
    """A `StructuredOutputs` as the HTTP API's `structured_outputs` object: its one constraint (a
    schema as JSON text is taken as such there) and its whitespace option when set."""
    name = "json" if spec.kind == "json_schema" else spec.kind
    fields: dict[str, Any] = {name: list(spec.choice) if name == "choice" else getattr(spec, spec.kind)}
    if spec.disable_any_whitespace:
        fields["disable_any_whitespace"] = True
    return fields


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


def check_options(options: dict[str, Any]) -> None:
    """A conversation's options (`ask`'s, `timeout_s` among them), checked when it is made: raise
    TypeError on an unknown option now rather than at the conversation's first turn."""
    build_header(None, 0, "", {k: v for k, v in options.items() if k != "timeout_s"},
                 [Message.user(VIDEO, "?")])  # fmt: skip


def detokenize_request(
    token_ids: Sequence[int], request_id: str
) -> gateway_pb2.GatewayServiceDetokenizeRequest:
    """The request of `detokenize`; TypeError for a value of the wrong type, ValueError for an id
    past 32 bits. The server checks the ids against its vocabulary (INVALID_ARGUMENT)."""
    if isinstance(token_ids, (str, bytes)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in token_ids
    ):
        raise TypeError(f"token_ids must be a list of token ids (integers), got {_shown(token_ids)}")
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {_shown(request_id)}")
    _typed(gateway_pb2.GatewayServiceDetokenizeRequest, {"token_ids": list(token_ids)})  # 32 bits each
    return gateway_pb2.GatewayServiceDetokenizeRequest(request_id=request_id, token_ids=token_ids)
