"""A streamed chat answer's chunks (`chat.completion.chunk`s) and a streamed legacy completion's
(`text_completion`s), shaped from the pipeline's events as they come. No HTTP here: the bodies
are framed as server-sent events by `epd.gateway.sse_stream.write_chat_events`.

A stream, as vLLM's: per choice, its opening (chat's: the assistant's role and "" content, then
with `echo` the echoed text in a chunk of its own); each token step's one chunk (chat's text
parted into reasoning and content by the reasoning parser, the content read for tool calls by the
choice's tool stream (hermes' steps with `content`, null beside calls, as vLLM's hermes sets it; no
empty `tool_calls`, which vLLM's DeltaMessage leaves out), all the step's deltas in one, as vLLM's
parsers give one DeltaMessage a step; with `include_reasoning` false under a parser, `reasoning`
(and its alias `reasoning_content`) null on each delta a parser read that has content or calls, as
vLLM's parser sets it; a completion's with its logprobs' text offsets, its first step's text after the echoed
prompt with `echo`, the prompt's logprobs first), a step that says nothing (its text held back by
a parser) making no chunk unless it carries logprobs or asked-for token ids; each choice's finish
reason on the chunk of its final step (its parsers' held-back tails joined to it), sent as it
finishes while others go on, the last one's with the summary, which it carries as `epd`
details; with stream_options include_usage a last chunk of no choices with the usage. Chunks list
their tokens' ids (`token_ids`) only with vLLM's `return_token_ids` (null otherwise: every chunk of
tokens, as vLLM's; chat's role and echo chunks have no such field); neither ids nor logprobs with
`include_reasoning` false under a parser (reasoning, or auto tool alone), as vLLM's. Each choice's
first chunk carries the prompt's ids (`prompt_token_ids`, null unless asked): chat's role chunk at
its top, a completion's in its choice (with `echo` the chunk joining the echo to the first step),
where its other chunks have null, as vLLM's. A chat chunk has `stop_reason` only with its finish
reason (a completion's every chunk, null until then), and `usage` only with continuous_usage_stats
(the usage so far; chat's with `completion_tokens_details`, its choice's reasoning tokens so far,
null without a reasoning parser), as vLLM's chunks, which it writes without the fields it left unset
(`model_dump_json(exclude_unset=True)`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from epd.gateway.ask_types import AskSummary, PromptLogprobs, PromptTokenIds
from epd.gateway.chat_answer import hides_token_metadata
from epd.gateway.chat_request import ChatRequest
from epd.gateway.completions_protocol import text_completion_chunk
from epd.gateway.logprobs_protocol import chat_logprobs, completion_logprobs
from epd.gateway.reasoning import MarkerIdsReader, ReasoningStream, delta_fields
from epd.gateway.summary_fields import epd_details, usage
from epd.gateway.tool_parsers.answer import ToolAnswerStream, tool_finish_reason
from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.logprobs import TokenLogprob
from epd.stages.contracts import StageEvent, TokenStep
from epd.stages.names import Stage


class ChatChunks:
    """One streamed answer's chunk bodies: `note` the events before its tokens (prefill's prompt
    token count, the prompt's logprobs and token ids), then each choice's `opening` and chat's
    `echo`, each token step's chunk (`add`) and the end's (`finish`). `thinking` None: no reasoning
    parser; `read_marker_ids`: reads the think markers' token ids, by which the reasoning tokens are
    counted, at each choice's first token (None, or not known then: by the text)."""

    def __init__(
        self,
        chat: ChatRequest,
        request_id: str,
        thinking: bool | None,
        read_marker_ids: MarkerIdsReader | None = None,
        created: int | None = None,
    ) -> None:
        self.chat = chat
        self.request_id = request_id
        self.thinking = thinking
        self.created = int(time.time()) if created is None else created
        self.num_tokens = 0
        """The answer's tokens so far, every choice's (continuous usage; a cut's status goes by it)."""
        self.num_prompt_tokens = 0  # from prefill's "finished" event, for continuous usage
        # Each choice's tokens so far, by index: a chunk's continuous usage counts its own choice's,
        # as vLLM's (`previous_num_tokens[i]`); the final usage chunk sums them.
        self.choice_tokens: dict[int, int] = {}
        # Characters of each choice's text sent so far, by index (a completion's logprobs text_offset).
        self.text_offsets: dict[int, int] = {}
        # The prompt's, when prefill computed them (`PromptLogprobs`): a completion's echo with
        # logprobs streams them with the prompt's text.
        self.prompt_logprobs: Sequence[TokenLogprob] | None = None
        # The prompt's ids, when prefill sent them (`PromptTokenIds`): each choice's first chunk's.
        self.prompt_token_ids: list[int] | None = None
        self.begun: set[int] = set()  # the choices whose first chunk went out, by index
        # Each choice's text parted into reasoning and content, by index (with --reasoning-parser),
        # and the reasoning tokens of those finished (the final usage's).
        self.parted = (
            {}
            if thinking is None
            else {i: ReasoningStream(thinking, read_marker_ids) for i in range(chat.generation.n)}
        )
        self.reasoning_tokens = 0
        # Each finished choice's reasoning tokens, by index (its chunks' continuous usage).
        self.choice_reasoning_tokens: dict[int, int] = {}
        # Each choice's content parted into text and tool calls, by index (with tools to parse or force).
        self.tooled = (
            {i: ToolAnswerStream(chat.tool_choice) for i in range(chat.generation.n)}
            if chat.tool_choice.mode != "none" and chat.raw_prompt is None
            else {}
        )
        self.finished: set[int] = set()  # the choices whose finish chunk went out, by index
        # A completion's choices whose first step has yet to carry the echoed prompt, by index
        # (vLLM's: the prompt's text and logprobs go in front of the first step's, in its chunk).
        self.unechoed = set(range(chat.generation.n)) if chat.raw_prompt is not None and chat.echo else set()
        self.echo_held = False  # `last_chunks` holds a completion's echo
        # The last choice's final step's chunks, held back by `add` until the summary's details.
        self.last_chunks: list[dict[str, Any]] = []

    def note(self, event: StageEvent | PromptLogprobs | PromptTokenIds) -> None:
        """An event before the tokens: prefill's "finished" (the prompt's token count, for
        continuous usage), the prompt's logprobs (a completion's echo streams them) or its token ids."""
        if isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event.prompt_logprobs
        elif isinstance(event, PromptTokenIds):
            self.prompt_token_ids = event.prompt_token_ids
        elif event.stage == Stage.PREFILL and event.state == "finished":
            self.num_prompt_tokens = int(event.details.get("num_prompt_tokens", 0))

    def opening(self, index: int) -> list[dict[str, Any]]:
        """Choice `index`'s first chunk, the assistant's role (chat's, as vLLM's; a legacy
        completion has none)."""
        if self.chat.raw_prompt is not None:
            return []
        role = {"role": self.chat.response_role, "content": ""}
        return [
            self._framed(
                chunk_body(self.request_id, self.chat.model, self.created, role, index=index, opening=True)
            )
        ]

    @property
    def echo_is_costly(self) -> bool:
        """The next chunks may carry the prompt's logprobs (a completion's echo with logprobs, up
        to half a million entries): the writer makes and writes them off the event loop."""
        return (
            bool(self.unechoed or self.echo_held)
            and self.prompt_logprobs is not None
            and self.chat.generation.logprobs is not None
        )

    def echo(self, index: int) -> list[dict[str, Any]]:
        """Choice `index`'s echoed text in a chat answer, in a chunk of its own after the role's as
        vLLM's chat streams it, with no logprobs and no `token_ids` field (none without `echo`; a
        completion's echo joins its first step's chunk, `add`)."""
        if self.chat.raw_prompt is not None or not (echoed := self.chat.echoed_text):
            return []
        return [
            self._framed(
                chunk_body(
                    self.request_id,
                    self.chat.model,
                    self.created,
                    {"content": echoed},
                    index=index,
                    opening=True,
                )
            )
        ]

    def add(self, step: TokenStep) -> list[dict[str, Any]]:
        """A token step's chunk: its text's (the reasoning parser's split and the tool calls read
        so far, in one delta as vLLM's parsers give one a step; a completion's first step after
        its echoed prompt), the step's finish reason on it when it ends its choice, as vLLM's. A
        step that says nothing (a parser holding its text back) makes no chunk unless the chunk
        would carry its logprobs or the token ids asked for, as vLLM's. The last choice to end
        waits for the summary (`finish`)."""
        self.num_tokens += len(step.token_ids)
        self.choice_tokens[step.index] = self.choice_tokens.get(step.index, 0) + len(step.token_ids)
        chat = self.chat
        chunks: list[dict[str, Any]] = []
        echoed = step.index in self.unechoed
        if echoed:
            chunks.append(self._echoed(step))
        # echo_only's one step is its echo: no other step comes (max_tokens 1)
        elif (step.token_ids or step.text) and not chat.echo_only:
            split = self.parted[step.index].add(step.text, step.token_ids) if self.parted else None
            delta = None if split is None else delta_fields(split, chat.include_reasoning)
            logprobs = None if self.metadata_hidden else step.logprobs
            if self.tooled:
                delta = _tool_delta(
                    self.tooled[step.index], delta, step.text if split is None else split.content
                )
            if delta is not None and self.metadata_hidden:  # a parser read the step
                delta = _reasoning_left_out(delta)
            # (a final step that says nothing still ends its choice: `_finish_choice`'s bare chunk)
            if delta != {} or logprobs is not None or self.token_ids_shown:
                chunks.append(
                    _delta_chunk(
                        chat,
                        self.request_id,
                        self.created,
                        step.text,
                        self._ids(step.token_ids),
                        logprobs,
                        self.text_offsets.get(step.index, 0),
                        step.index,
                        delta,
                    )
                )
            self.text_offsets[step.index] = self.text_offsets.get(step.index, 0) + len(step.text)
        if step.finish_reason:
            if len(self.finished) + 1 == chat.generation.n:
                self.last_chunks = chunks  # the summary's details go on its end
                self.echo_held = echoed
                return []
            chunks = self._finish_choice(step.index, step.finish_reason, step.stop_reason, chunks)
        return [self._framed(chunk) for chunk in chunks]

    def finish(self, summary: AskSummary) -> list[dict[str, Any]]:
        """The answer's end: the choices not finished yet (the last one's final step, held back by
        `add`, its last chunk carrying the summary as `epd_details`), then with include_usage the
        usage chunk."""
        self.num_prompt_tokens = summary.num_prompt_tokens
        self.echo_held = False
        chunks: list[dict[str, Any]] = []
        left = [c for c in summary.all_choices() if c.index not in self.finished]
        for choice in left:
            last = choice is left[-1]
            chunks += self._finish_choice(
                choice.index,
                choice.finish_reason,
                choice.stop_reason,
                self.last_chunks if last else [],
                epd_details(summary) if last else None,
            )
        if self.chat.include_usage:
            chunks.append(
                {
                    **_final_chunk(self.chat, self.request_id, self.created, None),
                    "choices": [],
                    "usage": usage(summary, None if self.thinking is None else self.reasoning_tokens),
                }
            )
        return [self._framed(chunk) for chunk in chunks]

    @property
    def metadata_hidden(self) -> bool:
        """Whether the chunks leave out their tokens' logprobs and ids (`hides_token_metadata`)."""
        return hides_token_metadata(self.chat.parser_on, self.chat.include_reasoning)

    @property
    def token_ids_shown(self) -> bool:
        """Whether the chunks list their tokens' ids: asked for (`return_token_ids`), not hidden."""
        return self.chat.return_token_ids and not self.metadata_hidden

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        """A chunk's `token_ids`: `token_ids` when the request asked for them, else None (none)."""
        return token_ids if self.token_ids_shown else None

    def _finish_choice(
        self,
        index: int,
        reason: str,
        stop: StopReason,
        chunks: list[dict[str, Any]],
        details: dict | None = None,
    ) -> list[dict[str, Any]]:
        """Choice `index`'s end: its final step's chunk (`chunks`, none when the step said nothing)
        with the tails its parsers held back (a reasoning marker's start, a tool call's text)
        joined to its delta, vLLM's one chunk a step, and its finish reason ("tool_calls" when it
        made calls, as vLLM's; an empty delta when there is nothing to say) and, on the request's
        last, the summary's `epd` details."""
        chat = self.chat
        self.finished.add(index)
        deltas = []
        if (text := self.parted.pop(index, None)) is not None:
            if delta := delta_fields(text.finish(), chat.include_reasoning):
                deltas.append(delta)
            self.reasoning_tokens += text.num_reasoning_tokens
            self.choice_reasoning_tokens[index] = text.num_reasoning_tokens
        said: list[dict[str, Any]] = []  # the tool stream's tails
        if (calls := self.tooled.pop(index, None)) is not None:
            deltas += (said := calls.finish())
            reason = tool_finish_reason(chat.tool_choice, calls.num_calls, reason or "stop", streamed=True)
        if deltas and chunks:
            choice = chunks[-1]["choices"][0]
            choice["delta"] = self._parsed(calls, joined_delta([choice["delta"], *deltas]), said)
        elif deltas:
            chunks = [
                chunk_body(
                    self.request_id,
                    chat.model,
                    self.created,
                    self._parsed(calls, joined_delta(deltas), said),
                    token_ids=self._ids([]),
                    index=index,
                )
            ]
        if not chunks:
            chunks = [_final_chunk(chat, self.request_id, self.created, index, self._ids([]))]
        _finished(chunks[-1]["choices"][0], reason or "stop", stop)
        if details is not None:
            chunks[-1]["epd"] = details
        return chunks

    def _parsed(
        self, calls: ToolAnswerStream | None, delta: dict[str, Any], said: Sequence[dict]
    ) -> dict[str, Any]:
        """A final step's delta with its parsers' tails joined, as vLLM's parser writes it: the tool
        parser's fields (`_tool_message`), and the reasoning's left out (`_reasoning_left_out`)."""
        delta = _tool_message(calls, delta, said)
        return _reasoning_left_out(delta) if self.metadata_hidden else delta

    def _framed(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """`chunk` as it goes out (every chunk goes through here, once, in the order sent): with
        continuous_usage_stats the usage so far (its choice's tokens), unless it has its own (the
        usage chunk's); with include_usage alone none, as vLLM's (it sets a chunk's `usage` only
        for continuous usage); and the prompt's ids on its choice's first chunk (`_with_prompt_ids`)."""
        self._with_prompt_ids(chunk)
        if self.chat.continuous_usage and "usage" not in chunk:
            index = chunk["choices"][0]["index"]
            so_far = self.choice_tokens.get(index, 0)
            chunk["usage"] = {
                "prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": so_far,
                "total_tokens": self.num_prompt_tokens + so_far,
            }
            if self.chat.raw_prompt is None:  # chat's: vLLM's completions leave the field unset
                chunk["usage"]["completion_tokens_details"] = self._reasoning_so_far(index)
        if "prompt_token_ids" in chunk:  # after the usage, in vLLM's order of the fields
            chunk["prompt_token_ids"] = chunk.pop("prompt_token_ids")
        return chunk

    def _reasoning_so_far(self, index: int) -> dict[str, int] | None:
        """A chat chunk's continuous usage's `completion_tokens_details`: choice `index`'s
        reasoning tokens so far, null without `--reasoning-parser`, as vLLM's chat sets the field
        on every such chunk (`_make_completion_tokens_details(previous_reasoning_tokens[i])` if it
        has a reasoning parser, else None, `vllm/entrypoints/openai/chat_completion/serving.py`,
        006c49d)."""
        if self.thinking is None:
            return None
        parted = self.parted.get(index)
        so_far = self.choice_reasoning_tokens.get(index, 0) if parted is None else parted.num_reasoning_tokens
        return {"reasoning_tokens": so_far}

    def _with_prompt_ids(self, chunk: dict[str, Any]) -> None:
        """vLLM's `prompt_token_ids` on the first chunk of each choice (null unless asked): chat's
        role chunk at its top (its other chunks have no such field), a completion's in its choice
        (its other chunks' null, as vLLM writes every field of them)."""
        if not chunk["choices"]:
            return  # the usage chunk
        choice = chunk["choices"][0]
        first = choice["index"] not in self.begun
        self.begun.add(choice["index"])
        ids = self.prompt_token_ids if first and self.chat.return_token_ids else None
        if self.chat.raw_prompt is not None:
            choice["prompt_token_ids"] = ids
        elif first:
            chunk["prompt_token_ids"] = ids

    def cut(self) -> list[dict[str, Any]]:
        """The chunks `add` held back for the summary, without their finish reason, when the
        answer fails before it (the error event follows them)."""
        chunks, self.last_chunks = self.last_chunks, []
        self.echo_held = False
        return [self._framed(chunk) for chunk in chunks]

    def _echoed(self, step: TokenStep) -> dict[str, Any]:
        """A completion's first step of choice `index` under `echo`, as vLLM's stream makes it:
        the prompt's text and then the step's (the prompt alone with max_tokens 0, vLLM's echo
        without generation), with logprobs the prompt's tokens' (the first with nulls) then the
        step's, their offsets from 0; its token ids the step's (the prompt's are no generated
        token's). The choice's later offsets go on from this chunk's text's length, as vLLM's
        `previous_text_lens`."""
        self.unechoed.discard(step.index)
        generated = not self.chat.echo_only
        text = self.chat.echoed_text + (step.text if generated else "")
        logprobs = None
        if self.chat.generation.logprobs is not None:
            logprobs = [*(self.prompt_logprobs or ()), *((step.logprobs or []) if generated else [])]
        self.text_offsets[step.index] = len(text)
        return _delta_chunk(
            self.chat, self.request_id, self.created, text, self._ids(step.token_ids), logprobs, 0, step.index
        )


def _finished(choice: dict[str, Any], reason: str, stop: StopReason) -> None:
    """A chunk's `choice` made its choice's last: its finish reason and vLLM's `stop_reason` after
    it, the field's place in vLLM's choice (a chat chunk has none before: vLLM sets it on the
    finish chunk alone)."""
    fields = [(key, value) for key, value in choice.items() if key != "stop_reason"]
    choice.clear()
    for key, value in fields:
        choice[key] = value
        if key == "finish_reason":
            choice.update(finish_reason=reason, stop_reason=stop)


def _tool_delta(
    stream: ToolAnswerStream, delta: dict[str, Any] | None, content: str | None
) -> dict[str, Any]:
    """A step's delta with its content (`content`, after the reasoning parser's split when one is
    set) passed through the choice's tool stream: the reasoning fields and all the tool stream's
    deltas for the step in one (`joined_delta`), as vLLM's parsers give one DeltaMessage a step."""
    step = {k: v for k, v in (delta or {}).items() if k != "content"}
    said = stream.add(content) if content else []
    return _tool_message(stream, joined_delta([step, *said]), said)


def _tool_message(
    stream: ToolAnswerStream | None, delta: dict[str, Any], said: Sequence[dict]
) -> dict[str, Any]:
    """`delta`, a step's, as vLLM's tool parser writes it when the step's tool stream said
    something (`said`): hermes' with `content` (null without text) first, vLLM's `DeltaMessage`
    field order (`ToolAnswerStream.sets_content`); as it is otherwise (no tool stream: None)."""
    if stream is None or not said or not stream.sets_content:
        return delta
    return {"content": delta.get("content"), **{k: v for k, v in delta.items() if k != "content"}}


def _reasoning_left_out(delta: dict[str, Any]) -> dict[str, Any]:
    """`delta`, one a parser read, with `include_reasoning` false: vLLM's parser sets the reasoning
    of each delta it keeps, one with content or calls, to None (`Parser.parse_delta`,
    `vllm/parser/abstract_parser.py` 00cd9d7, `vllm/parser/engine/parser_engine.py` 001ba1e), so
    `model_dump_json(exclude_unset=True)` writes `"reasoning": null` after `content`, before
    `tool_calls` (`DeltaMessage`'s field order); epd's alias `reasoning_content` with it. The
    others it drops (here they hold nothing: their reasoning was never put in)."""
    if not (delta.get("content") or delta.get("tool_calls")):
        return delta
    head = {"content": delta["content"]} if "content" in delta else {}
    rest = {k: v for k, v in delta.items() if k not in ("content", "reasoning", "reasoning_content")}
    return {**head, "reasoning": None, "reasoning_content": None, **rest}


def joined_delta(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Chat deltas made one, in order: their texts (`content`, the reasoning fields) joined, their
    `tool_calls` listed, one entry per call, a call's pieces joined (its header's id, type and name
    with its arguments' text), as vLLM's one DeltaMessage of a step holds them."""
    out: dict[str, Any] = {}
    for delta in deltas:
        for key, value in delta.items():
            if key == "tool_calls":
                calls = out.setdefault("tool_calls", [])
                for call in value:
                    if calls and calls[-1]["index"] == call["index"]:
                        last = calls[-1]
                        arguments = last["function"].get("arguments", "") + call["function"].get(
                            "arguments", ""
                        )
                        calls[-1] = {**last, "function": {**last["function"], "arguments": arguments}}
                    else:
                        calls.append({**call, "function": dict(call["function"])})
            elif isinstance(out.get(key), str) and isinstance(value, str):
                out[key] += value
            else:
                out[key] = value
    return out


def _delta_chunk(
    chat: ChatRequest,
    request_id: str,
    created: int,
    text: str,
    token_ids: list[int] | None,
    logprobs: Sequence[TokenLogprob] | None = None,
    text_offset: int = 0,
    index: int = 0,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A streamed answer's chunk of new text for choice `index`: chat's delta, or a legacy
    completion's text; `token_ids` None: not asked for (null). `logprobs`: those of `token_ids`
    when the request asked (a completion's first `text_offset` is the length of the choice's text
    sent before this chunk, as vLLM streams it), with an echo the prompt's tokens' first (the first
    with nulls).
    `delta`: chat's, the text parted by the reasoning parser (None: `{"content": text}`)."""
    if chat.raw_prompt is not None:
        return text_completion_chunk(
            request_id,
            chat.model,
            created,
            text,
            token_ids=token_ids,
            logprobs=None if logprobs is None else completion_logprobs(logprobs, text_offset),
            index=index,
        )
    return chunk_body(
        request_id,
        chat.model,
        created,
        {"content": text} if delta is None else delta,
        token_ids=token_ids,
        logprobs=logprobs,
        index=index,
    )


def _final_chunk(
    chat: ChatRequest, request_id: str, created: int, index: int | None, token_ids: list[int] | None = None
) -> dict[str, Any]:
    """A chunk of no text for choice `index` (0 when None: the usage chunk's frame): the frame of a
    choice's finish when its final step made no chunk (`token_ids`: [] when asked, else None)."""
    index = index or 0
    if chat.raw_prompt is not None:
        return text_completion_chunk(request_id, chat.model, created, "", token_ids=token_ids, index=index)
    return chunk_body(request_id, chat.model, created, {}, token_ids=token_ids, index=index)


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    token_ids: list[int] | None = None,
    logprobs: Sequence[TokenLogprob] | None = None,
    index: int = 0,
    opening: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk` of choice `index`, not its last (`_finished` adds the finish
    reason's `stop_reason`, vLLM's, which its other chunks leave out); `token_ids` (extra) are the
    tokens this chunk's text came from, None (null) when not asked, `logprobs` theirs when the
    request asked. `opening`: the role's or the echo's chunk, which no generated token made: no
    `token_ids` field, as vLLM's (its other chunks set the field, null when not asked)."""
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": None if logprobs is None else chat_logprobs(logprobs),
        "finish_reason": None,
    }
    if not opening:
        choice["token_ids"] = token_ids
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
