"""OpenAI chat-completions JSON -> the pipeline's request, `ChatRequest` (no HTTP in here), which
legacy completions and the Responses API build too.

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
`epd.gateway.structured_request`), with vLLM's meanings (`epd.gateway.generation_options`); the
chat template's variables go in vLLM's `chat_template_kwargs` (`{"enable_thinking": false}`)
beside its `add_generation_prompt` and `continue_final_message`; vLLM's `include_reasoning` (false: the reasoning left out of a thinking
model's answer, which `--reasoning-parser` parts: `epd.gateway.reasoning`); OpenAI's `tools` and
`tool_choice` (`epd.gateway.tool_request`; the answer's calls: `epd.gateway.tool_parsers`), with an
assistant's `tool_calls` and `tool` messages in the conversation; frame sampling goes in
one extra object, `"media": {"fps", "max_frames", "min_frames", "num_frames", "max_pixels",
"start_time_s", "end_time_s"}` (with the openai client: `extra_body={"media": {...}}`), and token
dropping in `"pruning": {"preset": "balanced", "knobs": {"kv_keep_ratio": 0.25}}`
(`epd.gateway.media_options`). The messages are read by `epd.gateway.chat_messages`; the
answer is `epd.gateway.chat_answer`'s (whole) or `epd.gateway.chat_chunks`' (streamed).
Fields left out take the server's defaults, which are greedy: unlike OpenAI, a missing
`temperature` means 0. A field of OpenAI's or vLLM's that this server does not implement is
refused with a 400 unless it asks for nothing; one it does not know is logged
(`epd.gateway.request_fields`).
vLLM's `add_generation_prompt` and `continue_final_message` say how the chat template ends the
prompt, and its `echo` puts the last message's text in front of the answer when that message's
role is the answer's (with `continue_final_message`: the whole assistant message comes back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from epd.gateway.chat_messages import parse_messages
from epd.gateway.generation_options import parse_generation
from epd.gateway.json_fields import boolean_field, checked_text
from epd.gateway.logprobs_protocol import chat_logprobs_option, prompt_logprobs_option
from epd.gateway.media_options import parse_pruning, parse_sampling
from epd.gateway.request_fields import (
    KNOWN_CHAT_FIELDS,
    UNSUPPORTED_CHAT_FIELDS,
    check_model,
    refuse_unsupported_fields,
)
from epd.gateway.tool_request import ToolChoice, forced_structured_outputs, parse_tools
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.chat_template import check_request_chat_template
from epd.stages.contracts import check_cache_salt
from epd.stages.errors import InvalidRequest
from epd.stages.messages import ChatTemplateOptions, Message, check_messages
from epd.stages.raw_prompt import RawPrompt
from epd.stages.template_kwargs import check_chat_template_kwargs
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions


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
    or streamed (each chunk its step's), and the answer the prompt's (`prompt_token_ids`: chat's at
    the top, a completion's in each choice; a stream's in each choice's first chunk), which prefill
    sends back for it (`GenerationConfig.return_prompt_token_ids`: the gateway has no tokenizer);
    null otherwise, where vLLM writes them null."""
    include_reasoning: bool = True
    """vLLM's `include_reasoning`: false leaves a thinking model's reasoning out of the answer
    (with `--reasoning-parser`; without one the answer is the text whole, as vLLM's), and with any
    parser (`parser_on`) every token's logprobs and ids (`hides_token_metadata`)."""
    parser_on: bool = False
    """A parser reads this chat answer: vLLM's chat serving has its `parser` object, which
    `ParserManager.get_parser` makes for `--reasoning-parser`, or for `--enable-auto-tool-choice`
    with `--tool-call-parser` (a tool parser alone too; the parser flag without auto makes none).
    Set by the front door from the server's flags (`HttpApiConfig.parser_on`); False for a legacy
    completion, which vLLM does not parse."""
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
        sampling=parse_sampling(body.get("media"), sampling_defaults),
        pruning=parse_pruning(body.get("pruning")),
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
    return_token_ids = boolean_field(body, "return_token_ids", False)
    return {
        "model": model,
        "generation": replace(
            parse_generation(body, generation_defaults),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs_option(body, stream),
            return_prompt_token_ids=return_token_ids,  # prefill sends them (vLLM's prompt_token_ids)
        ),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": include_usage
        and boolean_field(
            stream_options, "continuous_usage_stats", False, "stream_options.continuous_usage_stats"
        ),
        "cache_salt": check_cache_salt(checked_text(body.get("cache_salt"), "cache_salt")),
        "request_id": checked_text(body.get("request_id"), "request_id"),
        "return_token_ids": return_token_ids,
    }
