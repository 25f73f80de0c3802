"""A whole chat answer's body (`chat.completion`) from the pipeline's summary (no HTTP in here):
each choice's message (its text whole, or parted into reasoning and content by
`--reasoning-parser`; its tool calls taken out), logprobs, finish and stop reasons and, when
asked, token ids; then OpenAI's usage, vLLM's prompt logprobs and the extra `epd` object. A
streamed answer's chunks are `epd.gateway.chat_chunks`'."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from epd.gateway.ask_types import AskSummary, ChoiceSummary
from epd.gateway.logprobs_protocol import chat_logprobs, prompt_logprobs_json
from epd.gateway.reasoning import MarkerIdsReader, PartedAnswers, ReasoningSplit, message_fields, part_answers
from epd.gateway.summary_fields import epd_details, usage
from epd.gateway.tool_parsers.answer import answer_tool_calls, tool_finish_reason
from epd.gateway.tool_request import ToolChoice
from epd.stages.contracts import TokenStep


def hides_token_metadata(parser_on: bool, include_reasoning: bool) -> bool:
    """Whether a chat answer (whole or streamed) leaves out its tokens' logprobs and ids: when
    `include_reasoning` is false and a parser reads the answer (`ChatRequest.parser_on`: a
    reasoning parser, or an auto tool parser alone), exactly as vLLM's chat serving code decides it
    (`hide_stream_metadata` / `suppress_metadata`: `not request.include_reasoning and parser is not
    None`): a logprob entry's token text and the token ids would show the reasoning. Every token's
    goes, the content's too, as vLLM's (it does not part them)."""
    return parser_on and not include_reasoning


def completion_body(
    summary: AskSummary,
    model: str,
    created: int | None = None,
    role: str = "assistant",
    echoed: str = "",
    thinking: bool | None = None,
    include_reasoning: bool = True,
    parser_on: bool = False,
    tool_choice: ToolChoice = ToolChoice(),
    steps: Iterable[TokenStep] | None = None,
    read_marker_ids: MarkerIdsReader | None = None,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    """A chat answer's body; `role`: `ChatRequest.response_role`; `echoed`: `ChatRequest.echoed_text`,
    the content's start (usage still counts the generated tokens alone, as vLLM's). `thinking`
    (with `--reasoning-parser`: `epd.gateway.reasoning.thinking_on`; None without one) parts each
    choice's text, from the answer's token `steps` (needed then), into the message's reasoning and
    content, counting the reasoning's tokens in the same pass (`part_answers`, as the Responses
    answer parts and counts its steps; by token id with the served model's ids, `read_marker_ids`);
    `tool_choice` (`ChatRequest.tool_choice`) takes the content's tool calls into the message's
    `tool_calls` (`epd.gateway.tool_parsers`); `return_token_ids` (`ChatRequest`'s) lists each
    choice's token ids and the prompt's (null otherwise, as vLLM's); neither the choices' ids nor
    the logprobs with the reasoning left out under a parser (`parser_on`, `ChatRequest`'s:
    `hides_token_metadata`)."""
    parted = None
    if thinking is not None:
        if steps is None:
            raise ValueError("a reasoning parser parts the answer from its token steps: pass them")
        parted = part_answers(((s.index, s.text, s.token_ids) for s in steps), thinking, read_marker_ids)
    choices = []
    hidden = hides_token_metadata(parser_on, include_reasoning)
    for choice in summary.all_choices():
        message, num_calls = _message(role, echoed, choice, parted, include_reasoning, tool_choice)
        choices.append(
            {
                "index": choice.index,
                "message": message,
                "logprobs": None if choice.logprobs is None or hidden else chat_logprobs(choice.logprobs),
                "finish_reason": tool_finish_reason(tool_choice, num_calls, choice.finish_reason or "stop"),
                "stop_reason": choice.stop_reason,
                "token_ids": choice.token_ids if return_token_ids and not hidden else None,  # vLLM's null
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
        # vLLM's, with return_token_ids (the reasoning's hiding leaves them: they are the prompt's)
        "prompt_token_ids": summary.prompt_token_ids if return_token_ids else None,
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
    generated text's, as the stream, which sends chat's echo in a chunk of its own, reads them)."""
    if parted is None:
        content: str | None = choice.answer
        reasoning = message_fields(ReasoningSplit(None, content), include_reasoning)
    else:
        split = parted.split(choice.index)
        content = split.content
        reasoning = message_fields(split, include_reasoning)
    content, calls = answer_tool_calls(content, tool_choice)
    if echoed:
        content = echoed + (content or "")
    # vLLM's `ChatMessage` dumped whole (`model_dump()`), in its fields' order: the OpenAI fields
    # it never sets null, `tool_calls` only when there are calls (its serializer drops an empty
    # list), its `reasoning` null without a reasoning parser too (ours, `reasoning_content`, with it)
    message: dict[str, Any] = {"role": role, "content": content, **UNSET_MESSAGE_FIELDS}
    if calls:
        message["tool_calls"] = [call.to_json() for call in calls]
    return {**message, **reasoning}, len(calls)


UNSET_MESSAGE_FIELDS: dict[str, None] = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
}
"""The whole chat message's fields vLLM's `ChatMessage` has and leaves unset, written null as its
`model_dump()` writes them (`vllm/entrypoints/openai/chat_completion/protocol.py`): a model
writes no refusal, annotation or audio here, and a function call is a tool call."""
