"""The Responses API's answer (`POST /v1/responses`, `epd.gateway.responses_protocol` reads the
request): the pipeline's token steps shaped into a `response` object, or streamed as its semantic
events, in one pass that also counts the reasoning tokens and places the logprobs. No HTTP here.

The answer: {"id": "resp_<request id>", "object": "response", "status": "completed", or
"incomplete" with incomplete_details.reason "max_output_tokens" when max_output_tokens cut it,
"output": [a reasoning item (with a reasoning parser), a message item of one output_text part,
function_call items (`id` "fc_...", `call_id` "call_...", OpenAI's forms); the item
max_output_tokens cut "incomplete"], "usage": {input_tokens, output_tokens,
output_tokens_details.reasoning_tokens, total_tokens, ...}} and chat's `epd` details. Streamed:
SSE `event: <type>` / `data: {...}` pairs, each with its `sequence_number`: response.created,
response.in_progress, then per output item response.output_item.added, its parts' events (a
message's response.content_part.added / response.output_text.delta / .done /
response.content_part.done; a reasoning item's, vLLM's names, response.reasoning_part.added /
response.reasoning_text.delta / .done / response.reasoning_part.done; a call's
response.function_call_arguments.delta / .done), response.output_item.done, and last
response.completed (response.incomplete when cut) carrying the whole response; a stream that fails
after its 200 ends with `error` and response.failed (`ResponseEvents.failed`). The whole answer is
shaped by the same `ResponseEvents` fed the same steps (`response_body`), so both carry the same
items (but for a call cut after its name: streamed, its name went out and stays; whole, it is
text, as chat's).

Logprobs (`include: ["message.output_text.logprobs"]`): OpenAI's {"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]} per token on the message's output_text, the same
without "bytes" (OpenAI's event form) on its response.output_text.done and, each its own tokens',
on its response.output_text.delta events. A step's tokens go with the text they make: a reasoning
item or a call has no logprobs, so those tokens' are left out (vLLM's whole answer puts every
token's on the message). The content's tokens are told by token, those after the one that reads
`</think>` (`ReasoningStream.num_content_tokens`), so a step that begins inside the block and ends
it gives the message the tokens after the marker's; text held back (by a parser, or by decode for a
stop string's possible start) takes its tokens' along to the delta that releases it. The message's
last tokens whose text a stop string cut keep theirs (vLLM's whole message and chat keep every
token's): a last output_text.delta of no text carries them.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from epd.gateway.ask_types import AskSummary
from epd.gateway.chat_request import ChatRequest
from epd.gateway.logprobs_protocol import chat_logprobs
from epd.gateway.reasoning import MarkerIdsReader, ReasoningStream
from epd.gateway.summary_fields import epd_details
from epd.gateway.tool_parsers.answer import ToolAnswerStream
from epd.model_runtime.logprobs import TokenLogprob
from epd.stages.contracts import TokenStep


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _event_form(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output_text's logprobs as OpenAI's text delta and done events carry them: no "bytes"."""
    return [
        {
            "token": lp["token"],
            "logprob": lp["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in lp["top_logprobs"]],
        }
        for lp in logprobs
    ]


class ResponseEvents:
    """One response's semantic events, from its token steps as they come (`add`) to its end
    (`finish`): the reasoning parser's parts (`thinking` None: no parser) and the tool choice's
    calls (`ToolAnswerStream`, as chat's stream parts them) become output items, opened and closed
    in order. `output` is the items done; `response` the response object as it stands. `whole`: the
    answer is sent at its end (`response_body`): the calls are read as chat's whole answer reads
    them (`answer_tool_calls`), so a call cut after its name stays the message's text, not a
    function_call item whose arguments do not parse (a stream cannot take back a name sent)."""

    def __init__(
        self,
        chat: ChatRequest,
        request_id: str,
        thinking: bool | None,
        created: int | None = None,
        whole: bool = False,
        read_marker_ids: MarkerIdsReader | None = None,
    ):
        self.chat = chat
        self.request_id = request_id
        self.created = created if created is not None else int(time.time())
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._reasoning = None if thinking is None else ReasoningStream(thinking, read_marker_ids)
        self._tools = (
            ToolAnswerStream(chat.tool_choice, incremental=not whole)
            if chat.tool_choice.mode != "none"
            else None
        )
        self._open: dict[str, Any] | None = None  # the item being written
        self.started = False  # response.created sent
        self._text = ""  # the open item's text (a message's or reasoning's) or arguments
        self._logprobs = chat.generation.logprobs is not None  # the request asked for them
        self._text_logprobs: list[dict[str, Any]] = []  # the open message's, in OpenAI's form
        self._held_logprobs: list[TokenLogprob] = []  # of content tokens whose text no delta carried yet

    def start(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress."""
        self.started = True
        response = self.response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def add(
        self, text: str, token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprob] | None = None
    ) -> list[dict[str, Any]]:
        """The events of the answer's next step: its `text`, made by the tokens `token_ids`
        (counted as reasoning tokens while it thinks, `ReasoningStream.add`) with their `logprobs`
        when the request asked."""
        if self._logprobs and logprobs:
            # The content's tokens, the step's last ones (the others are reasoning's, which has
            # no logprobs); held until a delta carries their text.
            num_content = (
                len(logprobs)
                if self._reasoning is None
                else self._reasoning.num_content_tokens([lp.token for lp in logprobs])
            )
            self._held_logprobs += logprobs[len(logprobs) - num_content :]
        if self._reasoning is None:
            return self._step_events(self._content(text))
        split = self._reasoning.add(text, token_ids)
        events = self._reasoning_text(split.reasoning or "")
        return events + self._step_events(self._content(split.content or ""))

    def finish(self, summary: AskSummary) -> list[dict[str, Any]]:
        """The held-back tails, the last item's close and response.completed (or .incomplete:
        the item max_output_tokens cut is "incomplete" too, as OpenAI marks it)."""
        events = []
        if self._reasoning is not None:
            events += self._reasoning_text(self._reasoning.finish().reasoning or "")
        if self._tools is not None:
            events += self._deltas(self._tools.finish())
        if self._held_logprobs and self._open is not None and self._open["type"] == "message":
            # The message's last tokens made no text it got: a stop string cut it (or a character
            # was left unfinished). vLLM's message keeps their logprobs, every token's (chat's does
            # too, epd's and vLLM's): sent on a last delta of no text. Without a message there is
            # nothing to carry them (vLLM makes none for an answer of no text either).
            events += self._message_text("")
        self._held_logprobs = []
        status = "incomplete" if summary.finish_reason == "length" else "completed"
        events += self._close(status)
        response = self.response(status, summary)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=response)]

    def response(self, status: str, summary: AskSummary | None = None) -> dict[str, Any]:
        chat, echo = self.chat, self.chat.responses or {}
        body: dict[str, Any] = {
            "id": f"resp_{self.request_id}",
            "object": "response",
            "created_at": self.created,
            "model": chat.model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "output": list(self.output),
            "max_output_tokens": None
            if chat.generation.fit_max_new_tokens
            else chat.generation.max_new_tokens,
            "temperature": chat.generation.temperature,
            "top_p": chat.generation.top_p,
            "top_logprobs": chat.generation.logprobs,  # vLLM's: null when logprobs were not asked
            "store": False,
            "previous_response_id": None,
            **echo,
            "usage": None if summary is None else self._usage(summary),
        }
        if summary is not None:
            body["epd"] = epd_details(summary)
        return body

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The end of a stream that failed after its 200, from chat's error body
        (`epd.gateway.http_errors.error_body`): response.created and .in_progress first when
        no token came before (a keep-alive sent the 200), OpenAI's `error` event, and
        response.failed, the response with status "failed" and its `error`, as OpenAI ends a
        failed response (the open item stays out of its output: it was not done)."""
        inner = error["error"]
        # OpenAI's error codes here are names ("server_error", ...: a string or null in both the
        # `error` event and the failed response's `error`), not the HTTP status of chat's error
        # body, which a typed client refuses to parse: the error body's type.
        code = inner.get("type") or str(inner["code"])
        events = [] if self.started else self.start()
        events.append(self._event("error", code=code, message=inner["message"], param=None))
        response = self.response("failed")
        response["error"] = {"code": code, "message": inner["message"]}
        return events + [self._event("response.failed", response=response)]

    def _usage(self, summary: AskSummary) -> dict[str, Any]:
        """The Responses API's usage: chat's counts under its names, the reasoning tokens, and
        `cache_write_tokens` (OpenAI's client requires it; vLLM writes `cached_tokens` alone): the
        prompt tokens this request wrote into prefill's prefix cache, beside those it read there."""
        output = len(summary.token_ids)
        return {
            "input_tokens": summary.num_prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": summary.num_reused_prompt_tokens,
                "cache_write_tokens": summary.num_stored_prompt_tokens,
            },
            "output_tokens": output,
            "output_tokens_details": {
                "reasoning_tokens": 0 if self._reasoning is None else self._reasoning.num_reasoning_tokens
            },
            "total_tokens": summary.num_prompt_tokens + output,
        }

    def _step_events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A step's content `events`; the content tokens' logprobs no delta took went into a
        call's arguments (no logprobs there) unless the step sent no content: then its text is held
        back (or not made yet: part of a character), and they wait for the delta that releases it."""
        if events:
            self._held_logprobs = []
        return events

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._tools is None:
            return self._message_text(text)
        return self._deltas(self._tools.add(text))

    def _deltas(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat's deltas of the tool stream (content, or a call's opening and arguments) as events."""
        events = []
        for delta in deltas:
            if delta.get("content"):
                events += self._message_text(delta["content"])
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    events += self._close()
                    item = {
                        "id": _item_id("fc"),
                        "type": "function_call",
                        # OpenAI's form, as vLLM's stream names it (vLLM's whole answer keeps its
                        # tool parser's "chatcmpl-tool-..."): one form, streamed or not
                        "call_id": _item_id("call"),
                        "name": call["function"]["name"],
                        "arguments": "",
                        "status": "in_progress",
                    }
                    events += self._open_item(item)
                if arguments := call["function"].get("arguments"):
                    self._text += arguments
                    events.append(self._item_event("response.function_call_arguments.delta", delta=arguments))
        return events

    def _message_text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._close()
            item = {
                "id": _item_id("msg"),
                "type": "message",
                "role": "assistant",
                "content": [],
                "status": "in_progress",
            }
            events += self._open_item(item)
            part = self._text_part("")
            events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        self._text += text
        # The tokens that made this text (and any held back before it).
        logprobs = chat_logprobs(self._held_logprobs)["content"]
        self._held_logprobs = []
        self._text_logprobs += logprobs
        events.append(
            self._item_event(
                "response.output_text.delta", content_index=0, delta=text, logprobs=_event_form(logprobs)
            )
        )
        return events

    def _text_part(self, text: str) -> dict[str, Any]:
        """The message's output_text part: its logprobs with it when the request asked."""
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self._logprobs:
            part["logprobs"] = list(self._text_logprobs)
        return part

    def _reasoning_text(self, text: str) -> list[dict[str, Any]]:
        if not text or not self.chat.include_reasoning:  # vLLM's include_reasoning false: no reasoning item
            return []
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            events += self._close()
            events += self._open_item(
                {"id": _item_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            )
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._item_event("response.reasoning_part.added", content_index=0, part=part))
        self._text += text
        events.append(self._item_event("response.reasoning_text.delta", content_index=0, delta=text))
        return events

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._text, self._text_logprobs = item, "", []
        return [self._event("response.output_item.added", output_index=len(self.output), item=dict(item))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """The open item's done events, with its `status`; it joins `output`."""
        item, text = self._open, self._text
        if item is None:
            return []
        events = []
        if item["type"] == "message":
            part = self._text_part(text)
            logprobs = _event_form(self._text_logprobs)
            events.append(
                self._item_event("response.output_text.done", content_index=0, text=text, logprobs=logprobs)
            )
            events.append(self._item_event("response.content_part.done", content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            events.append(self._item_event("response.reasoning_text.done", content_index=0, text=text))
            events.append(self._item_event("response.reasoning_part.done", content_index=0, part=part))
            item["content"] = [part]
        else:
            item["arguments"] = text
            events.append(self._item_event("response.function_call_arguments.done", arguments=text))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self._open, self._text, self._text_logprobs = None, "", []
        return events

    def _item_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        return self._event(kind, item_id=self._open["id"], output_index=len(self.output), **fields)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def response_body(
    summary: AskSummary,
    chat: ChatRequest,
    thinking: bool | None,
    steps: Iterable[TokenStep],
    created: int | None = None,
    read_marker_ids: MarkerIdsReader | None = None,
) -> dict[str, Any]:
    """The whole answer's `response`: its token `steps` through the same `ResponseEvents` a stream
    goes through (which counts its reasoning tokens, by id with the served model's ids that
    `read_marker_ids` reads, and places its logprobs), at its end."""
    events = ResponseEvents(
        chat, summary.request_id, thinking, created, whole=True, read_marker_ids=read_marker_ids
    )
    for step in steps:
        events.add(step.text, step.token_ids, step.logprobs)
    return events.finish(summary)[-1]["response"]
