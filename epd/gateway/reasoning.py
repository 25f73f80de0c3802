"""vLLM's reasoning parsers (`--reasoning-parser qwen3 | deepseek_r1`): a thinking model's answer
split into its reasoning, the text inside `<think> ... </think>`, and its content, the text after.
No HTTP and no tokenizer in here: the chat door (`epd.gateway.http_api`) feeds each choice's
decoded text step by step, a whole answer's steps at its end (`part_answers`) or the stream's as
they come, and puts the parts in the message's `reasoning` (and its older name
`reasoning_content`) and `content`.

The split is on the decoded text, as vLLM's `extract_reasoning` splits it: in Qwen3's, Qwen3.5's
and DeepSeek-R1's tokenizers `<think>` and `</think>` are added tokens that are not special, so
`skip_special_tokens` keeps their text. A thinking template opens the block in the prompt
(Qwen3.5's ends it in "<think>\n"), so an answer begins inside it: everything up to the first
`</think>` is reasoning, and a `<think>` the model writes itself before that is dropped. No
`</think>` (the answer cut by max_tokens, or by a stop) leaves it all reasoning and the content
null. Qwen3's parser reads the request's `chat_template_kwargs.enable_thinking`: false (the
template closed an empty block in the prompt) makes the whole answer content, a `</think>` in it
included, as vLLM streams it; DeepSeek-R1's has no such switch.

The stream is split exactly as the whole answer is: a delta's tail that could begin a marker
(`<`, `</thi`, ...) is held back until the next delta shows what it is, or the answer ends, so a
marker split across deltas (or spelled in several tokens) is found all the same; the held text is
at most a marker's length.

The reasoning tokens (usage's `reasoning_tokens`) are counted by token id, as vLLM's parsers count
them, each its own way (`MarkerIds.later_blocks`: deepseek_r1 counts a block the model opens again
after its `</think>`, qwen3 does not): the gateway loads no tokenizer, so prefill reports the
markers' ids (`ModelInfo.reasoning_marker_ids`, read by `marker_ids`). Not where the text falls:
decode may send a step's text late (a stop string's possible start held back) or with the text of
tokens after `</think>`'s. Each choice's `ReasoningStream` reads the ids at its first token
(`MarkerIdsReader`), not when the request came: the gateway learns the model from prefill in the
background, so a request that came before may still have them by its first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from epd.model_runtime.reasoning_markers import REASONING_MARKERS
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.model_info import ModelInfo

START, END = REASONING_MARKERS  # "<think>", "</think>"


@dataclass(frozen=True)
class MarkerIds:
    """How a thinking answer's reasoning tokens are counted by id: the served model's `<think>`
    and `</think>` token ids, and whether the parser counts a block the model opens again after
    its `</think>` (`marker_ids`)."""

    start: int
    end: int
    later_blocks: bool = False
    """vLLM's deepseek_r1 counts them: its `BaseThinkingReasoningParser.count_reasoning_tokens`
    (vllm/reasoning/basic_parsers.py) counts every token inside `<think>` ... `</think>`,
    nested or again, by depth. Its qwen3 (the parser engine's Qwen3 grammar, vllm/parser/qwen3.py)
    leaves reasoning at the first `</think>` for good (docs/from-vllm.md cites both)."""


MarkerIdsReader = Callable[[], MarkerIds | None]
"""Reads the served model's `MarkerIds` as the gateway knows them now (`marker_ids` of its model
info; None: not known). A `ReasoningStream` calls it once, at its answer's first token: model info
that comes after the request but before any token is counted still counts the answer by id."""


REASONING_PARSERS = ("qwen3", "deepseek_r1")
"""The names `--reasoning-parser` takes, vLLM's: both split at `<think>` / `</think>`; qwen3
also reads `enable_thinking`; deepseek_r1 counts a block opened again (`MarkerIds.later_blocks`)."""


def parser_misfit(parser: str, info: ModelInfo | None) -> str | None:
    """Why `--reasoning-parser parser` cannot part the answers of the model `info` describes, or
    None when it can (or no parser is set, or the model is not known yet). vLLM refuses to start a
    parser whose markers are not single tokens of the tokenizer; epd's gateway loads no tokenizer
    and learns it from prefill (`ModelInfo.reasoning_markers`), so it refuses chat requests instead:
    without `</think>` in the vocabulary every answer would be all reasoning, its content null."""
    if not parser or info is None:
        return None
    missing = [marker for marker in REASONING_MARKERS if marker not in info.reasoning_markers]
    if not missing:
        return None
    return (
        f"--reasoning-parser {parser} needs a thinking model, whose tokenizer has {' and '.join(REASONING_MARKERS)} "
        f"as single tokens, but the served model ({info.model_type}) lacks {' and '.join(missing)}: "
        "the server's operator must restart it without --reasoning-parser or serve a thinking model"
    )


def marker_ids(info: ModelInfo | None, parser: str) -> MarkerIds | None:
    """The served model's `<think>` and `</think>` token ids as prefill reports them, with
    `--reasoning-parser parser`'s counting rule, or None when not known (no model info yet, a
    prefill from before them, replicas whose ids differ): then the reasoning tokens are counted by
    where the text falls (`ReasoningStream.add`)."""
    if info is None:
        return None
    start, end = info.reasoning_token_id(START), info.reasoning_token_id(END)
    return None if start is None or end is None else MarkerIds(start, end, parser == "deepseek_r1")


@dataclass(frozen=True)
class ReasoningSplit:
    """One answer's (or one delta's) text, parted. As vLLM's message: `reasoning` None when
    thinking was off; `content` None when the answer ended before any content (in a delta: ""
    when this delta has none)."""

    reasoning: str | None
    content: str | None


def thinking_on(parser: str, chat_template_kwargs: Mapping[str, Any]) -> bool:
    """Whether the answer begins inside a thinking block: qwen3's unless the request's template
    variables say `enable_thinking: false` (as Qwen's templates test it: `is false`)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")
    return not (parser == "qwen3" and chat_template_kwargs.get("enable_thinking") is False)


def constrained_after_reasoning(generation: GenerationConfig) -> GenerationConfig:
    """A chat request's settings under a reasoning parser: its structured output, if any, starts
    after the model's `</think>` (vLLM's default, `enable_in_reasoning` false), so a thinking
    model thinks freely and its content keeps to the constraint; at once when the prompt closed
    the block (`enable_thinking: false`). Prefill and decode hold it so
    (`StructuredOutputs.after_reasoning`)."""
    spec = generation.structured_outputs
    if spec is None or spec.after_reasoning:
        return generation
    return replace(generation, structured_outputs=replace(spec, after_reasoning=True))


def split_reasoning(text: str, thinking: bool) -> ReasoningSplit:
    """A whole answer's text parted at its first `</think>` (`thinking`: `thinking_on`): as one
    step of `part_answers`, so a whole text, a stream's deltas and a whole answer's steps are
    parted by the one machine (`ReasoningStream`)."""
    return part_answers([(0, text, ())], thinking).split(0)


class ReasoningStream:
    """One choice's streamed text, parted delta by delta; the parts joined are `split_reasoning`'s
    of the whole text (`finish` gives what was held back). Fed each step's token ids too, it
    counts the answer's reasoning tokens (`num_reasoning_tokens`) in the same pass; fed its tokens'
    texts, it tells which of them are the content's (`num_content_tokens`, for their logprobs).
    `read_marker_ids`: reads the served model's ids (`MarkerIdsReader`) at the first token; None
    (or its None then): not known, the tokens are counted by where the text falls."""

    def __init__(self, thinking: bool, read_marker_ids: MarkerIdsReader | None = None) -> None:
        self.in_reasoning = thinking
        """True until the text after `</think>` begins (False from the start with thinking off)."""
        self.num_reasoning_tokens = 0
        """The tokens inside the thinking block so far, its markers left out, as vLLM counts the
        Responses API's `usage.output_tokens_details.reasoning_tokens` and chat's
        `usage.completion_tokens_details.reasoning_tokens` (`add`)."""
        self._read_marker_ids = read_marker_ids
        self._marker_ids: MarkerIds | None = None  # read at the first token (`_ids`)
        self._ids_read = False
        self._depth = int(thinking)  # blocks open at this token (by id): the template's first
        self._own_start = thinking  # the model's `<think>` before its `</think>` opens no other
        self._start_dropped = False  # the model's own `<think>`, dropped once
        self._tokens_in_reasoning = thinking  # until a token reads `</think>` (`num_content_tokens`)
        self._held = ""  # the reasoning text's tail that may begin a marker: len < len(END)

    def add(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningSplit:
        """The parts of `text`, the next delta ("" for a part it has none of), made by the tokens
        `token_ids`; those inside the thinking block count as reasoning tokens. By id, as vLLM's
        parsers count them (`_count`): every token before the `</think>` token (from the answer's
        start, which the template opened), and with deepseek_r1 those of a block opened again
        after it, the markers' tokens left out, however decode sent their text. Without the ids
        (not known at the first token, `_ids`) a step's tokens count by where its text falls, each marker the text
        completes one of them that does not count."""
        ids = self._ids()
        if ids is not None:
            self._count(token_ids, ids)
        if not self.in_reasoning:
            return ReasoningSplit("", text)
        dropped = self._start_dropped
        split = self._split(text)
        if ids is None:
            num_markers = (not self.in_reasoning) + (self._start_dropped and not dropped)
            self.num_reasoning_tokens += max(0, len(token_ids) - num_markers)
        return split

    def _ids(self) -> MarkerIds | None:
        """The served model's marker ids, read once, at the answer's first token (its first `add`):
        read then rather than when the request came, as the gateway may learn them meanwhile
        (prefill's model info comes in the background); never changed after, so one answer is
        counted one way."""
        if not self._ids_read:
            self._ids_read = True
            self._marker_ids = None if self._read_marker_ids is None else self._read_marker_ids()
        return self._marker_ids

    def _count(self, token_ids: Sequence[int], ids: MarkerIds) -> None:
        """By id, as vLLM's parser counts (`MarkerIds.later_blocks`): a block the template opened
        counts from the answer's start, the model's own `<think>` in it taken for its opener (as
        the text split drops it); with `later_blocks`, each `<think>` after opens a block (nested
        ones too) that its `</think>` closes; without, the first `</think>` ends the count."""
        for token in token_ids:
            if token == ids.end:
                self._own_start = False
                self._depth = max(0, self._depth - 1) if ids.later_blocks else 0
            elif token == ids.start:
                if ids.later_blocks and not self._own_start:
                    self._depth += 1
                self._own_start = False
            elif self._depth:
                self.num_reasoning_tokens += 1

    def num_content_tokens(self, token_texts: Sequence[str]) -> int:
        """How many of the next step's tokens, the last ones, are the content's, by each token's
        text decoded alone (as logprobs name it; call it before `add`): those after the token that
        reads `</think>` (one token of a thinking model's tokenizer, `parser_misfit`), as vLLM's
        parsers tell them by token id. By token, not by where the step's text falls: decode may
        hold a step's text back (a stop string's possible start) and send it with later tokens.
        Should the text leave the block with no such token (the marker spelled in pieces), the
        tokens from the next step on are content."""
        if self._tokens_in_reasoning and not self.in_reasoning:
            self._tokens_in_reasoning = False
        if not self._tokens_in_reasoning:
            return len(token_texts)
        if END not in token_texts:
            return 0
        self._tokens_in_reasoning = False
        return len(token_texts) - token_texts.index(END) - 1

    def finish(self) -> ReasoningSplit:
        """The held-back tail at the answer's end: reasoning (no marker came of it)."""
        held, self._held = self._held, ""
        if not self.in_reasoning:
            return ReasoningSplit("", "")
        # A tail held as a possible `<think>` may be the model's own, whole (an answer cut right
        # after it): dropped as `split_reasoning` drops it, and its token is no reasoning token.
        dropped = self._start_dropped
        reasoning = self._drop_start(held)
        if self._start_dropped and not dropped and self._ids() is None:
            self.num_reasoning_tokens = max(0, self.num_reasoning_tokens - 1)
        return ReasoningSplit(reasoning, "")

    def _split(self, text: str) -> ReasoningSplit:
        pending = self._held + text
        end = pending.find(END)
        if end >= 0:
            self.in_reasoning, self._held = False, ""
            return ReasoningSplit(self._drop_start(pending[:end]), pending[end + len(END) :])
        keep = self._marker_prefix_len(pending)
        self._held = pending[len(pending) - keep :]
        return ReasoningSplit(self._drop_start(pending[: len(pending) - keep]), "")

    def _drop_start(self, reasoning: str) -> str:
        if self._start_dropped or START not in reasoning:
            return reasoning
        self._start_dropped = True
        return reasoning.replace(START, "", 1)

    def _marker_prefix_len(self, text: str) -> int:
        """Length of `text`'s longest tail that is a proper prefix of `</think>` (or of `<think>`
        while the model's own has not come): text that could still become a marker."""
        markers = (END,) if self._start_dropped else (END, START)
        for size in range(min(len(text), len(END) - 1), 0, -1):
            tail = text[-size:]
            if any(m.startswith(tail) for m in markers):
                return size
        return 0


def message_fields(split: ReasoningSplit, include_reasoning: bool) -> dict[str, str | None]:
    """A chat message's reasoning fields: vLLM's `reasoning` and its older name
    `reasoning_content`, which clients written for earlier vLLM and DeepSeek's API read; both
    null with `include_reasoning: false`."""
    reasoning = split.reasoning if include_reasoning else None
    return {"reasoning": reasoning, "reasoning_content": reasoning}


@dataclass(frozen=True)
class PartedAnswers:
    """A whole answer's choices, each parted into reasoning and content (`part_answers`)."""

    thinking: bool
    splits: Mapping[int, ReasoningSplit]
    """By choice index, those that had steps."""
    num_reasoning_tokens: int
    """Every choice's reasoning tokens (`ReasoningStream.num_reasoning_tokens`), summed: vLLM's
    chat usage `completion_tokens_details.reasoning_tokens`."""

    def split(self, index: int) -> ReasoningSplit:
        """Choice `index`'s parts (an empty answer's when it had no step)."""
        if index in self.splits:
            return self.splits[index]
        return ReasoningSplit("", None) if self.thinking else ReasoningSplit(None, "")


def part_answers(
    steps: Iterable[tuple[int, str, Sequence[int]]],
    thinking: bool,
    read_marker_ids: MarkerIdsReader | None = None,
) -> PartedAnswers:
    """A whole answer parted from its steps, each (choice index, text, token ids), in order, in
    one pass: every choice's through a `ReasoningStream` of its own (`read_marker_ids`: reads the
    served model's ids), as a stream parts it, which counts its reasoning tokens as it parts the text (the
    Responses answer's shape, `epd.gateway.responses_events.response_body`). As vLLM's whole
    message: `reasoning` None with thinking off; `content` None when nothing came after the block
    (or it never closed)."""
    streams: dict[int, ReasoningStream] = {}
    parts: dict[int, tuple[list[str], list[str]]] = {}
    for index, text, token_ids in steps:
        stream = streams.setdefault(index, ReasoningStream(thinking, read_marker_ids))
        split = stream.add(text, token_ids)
        reasoning, content = parts.setdefault(index, ([], []))
        reasoning.append(split.reasoning or "")
        content.append(split.content or "")
    splits = {}
    for index, stream in streams.items():
        # a held-back tail is reasoning; a held whole `<think>` at the end is dropped, no token
        reasoning, content = parts[index]
        reasoning.append(stream.finish().reasoning or "")
        joined = "".join(content)
        splits[index] = (
            ReasoningSplit("".join(reasoning), joined or None) if thinking else ReasoningSplit(None, joined)
        )
    return PartedAnswers(thinking, splits, sum(s.num_reasoning_tokens for s in streams.values()))


def delta_fields(split: ReasoningSplit, include_reasoning: bool) -> dict[str, str]:
    """A streamed chunk's delta of one `ReasoningStream` step: the reasoning fields while it
    thinks, `content` after, both in the delta that holds `</think>`; {} when the step has neither
    (its text held back, or the marker alone: the chunk still carries its tokens' ids)."""
    delta = {}
    if split.reasoning and include_reasoning:
        delta["reasoning"] = delta["reasoning_content"] = split.reasoning
    if split.content:
        delta["content"] = split.content
    return delta
