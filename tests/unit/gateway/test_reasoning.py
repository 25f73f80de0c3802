"""vLLM's reasoning parsers (`epd.gateway.reasoning`): a thinking model's answer parted at
`</think>` into reasoning and content, whole and as a stream of deltas (which must part it exactly
as the whole text, wherever the deltas cut it), and the chat message and chunk fields they fill."""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import pytest

from epd.gateway.ask_types import AskSummary, ChoiceSummary
from epd.gateway.chat_answer import completion_body
from epd.gateway.chat_request import parse_chat_request
from epd.gateway.config import HttpApiConfig
from epd.gateway.reasoning import (
    MarkerIds,
    ReasoningSplit,
    ReasoningStream,
    constrained_after_reasoning,
    delta_fields,
    marker_ids,
    part_answers,
    split_reasoning,
    thinking_on,
)
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.contracts import TokenStep
from epd.stages.errors import InvalidRequest
from epd.stages.model_info import ModelInfo, common_model_info
from epd.video.types import SamplingOptions

ANSWERS = [
    "\nthe square moves left</think>\n\nIt is red.",  # Qwen3.5: the template opened the block
    "<think>\nplan</think>answer",  # the model opens it itself (Qwen3 before 2507, DeepSeek-R1)
    "still thinking when max_tokens cut it",  # no </think>: all reasoning
    "</think>",  # an empty block, ended at once: reasoning "", content null
    "a</think>b</think>c<think>d",  # the first </think> ends it; the rest is content, markers and all
    "a < b and c </thin k> d <thin",  # near-misses of a marker are text
    "x<th</think>y",
    "<think>",  # cut right after the model's own opening marker: it is dropped, streamed or not
    "a<think>",
    "",
]


@pytest.mark.parametrize(
    "text,want",
    [
        ("\nthe square moves left</think>\n\nIt is red.", ("\nthe square moves left", "\n\nIt is red.")),
        ("<think>\nplan</think>answer", ("\nplan", "answer")),
        ("cut by max_tokens", ("cut by max_tokens", None)),
        ("<think>cut", ("cut", None)),
        ("done</think>", ("done", None)),  # nothing after the block: content null, as vLLM's
        ("a</think>b</think>c", ("a", "b</think>c")),
        ("a<think>b</think>c", ("ab", "c")),
    ],
)
def test_a_whole_answer_is_parted_at_its_first_end_marker(text, want):
    assert split_reasoning(text, thinking=True) == ReasoningSplit(*want)


def test_thinking_off_leaves_the_whole_answer_content():
    """Qwen3's `enable_thinking: false` closed the block in the prompt: a `</think>` the answer
    holds is text (as vLLM streams it); DeepSeek-R1's parser has no such switch."""
    assert not thinking_on("qwen3", {"enable_thinking": False})
    assert thinking_on("qwen3", {}) and thinking_on("qwen3", {"enable_thinking": True})
    assert thinking_on("qwen3", {"enable_thinking": 0})  # the template tests `is false`
    assert thinking_on("deepseek_r1", {"enable_thinking": False})
    assert split_reasoning("a</think>b", thinking=False) == ReasoningSplit(None, "a</think>b")
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'; known: qwen3, deepseek_r1"):
        thinking_on("granite", {})


def _streamed(deltas: list[str], thinking: bool = True) -> tuple[str, str, bool]:
    stream = ReasoningStream(thinking)
    parts = [stream.add(d) for d in deltas] + [stream.finish()]
    reasoning = "".join(p.reasoning or "" for p in parts)
    return reasoning, "".join(p.content or "" for p in parts), stream.in_reasoning


def _cuts(text: str, num_cuts: int):
    for points in itertools.combinations(range(1, len(text)), num_cuts):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("text", ANSWERS)
@pytest.mark.parametrize("thinking", [True, False])
def test_the_stream_parts_an_answer_as_the_whole_text_wherever_the_deltas_cut_it(text, thinking):
    """Every cut into two and three deltas, and one character at a time: the markers split across
    deltas (`</th` + `ink>`) are found, and the parts joined are the whole text's."""
    whole = split_reasoning(text, thinking)
    want = (whole.reasoning or "", whole.content or "", thinking and "</think>" not in text)
    cuts = [[text], list(text), *_cuts(text, 1), *(_cuts(text, 2) if len(text) < 40 else [])]
    for deltas in cuts:
        assert _streamed(deltas, thinking) == want, deltas


def test_a_delta_holds_back_only_what_could_begin_a_marker():
    stream = ReasoningStream(thinking=True)
    assert stream.add("it moves </th") == ReasoningSplit("it moves ", "")  # "</th" waits
    assert stream.add("ink>It is") == ReasoningSplit("", "It is")
    assert stream.add(" red.</think>") == ReasoningSplit("", " red.</think>")  # content from now on
    cut = ReasoningStream(thinking=True)
    assert cut.add("a <") == ReasoningSplit("a ", "")
    assert cut.add("b") == ReasoningSplit("<b", "")  # no marker came of it
    assert cut.add("<") == ReasoningSplit("", "")
    assert cut.finish() == ReasoningSplit("<", "")  # the answer ended (max_tokens): reasoning


def test_a_chunks_delta_carries_reasoning_while_it_thinks_and_content_after():
    assert delta_fields(ReasoningSplit("x", ""), True) == {"reasoning": "x", "reasoning_content": "x"}
    assert delta_fields(ReasoningSplit("x", "y"), True) == {
        "reasoning": "x",
        "reasoning_content": "x",
        "content": "y",
    }
    assert delta_fields(ReasoningSplit("x", "y"), False) == {"content": "y"}  # include_reasoning false
    assert delta_fields(ReasoningSplit("", ""), True) == {}


def _summary(answer: str) -> AskSummary:
    return AskSummary("r1", answer, [5, 6, 7], "length", 0, 0, 3, {}, 0, False, "", [])


def _parted(answer: str, **fields) -> dict:
    """`completion_body` of `_summary(answer)` under a reasoning parser, the answer its one step."""
    return completion_body(_summary(answer), "m", created=1, steps=[TokenStep([5, 6, 7], answer)], **fields)


def test_a_chat_message_is_vllms_whole_message_with_or_without_the_parser():
    """vLLM dumps its `ChatMessage` whole: the fields it leaves unset null, in its order, and
    `reasoning` null without a reasoning parser too (it had no reasoning key then)."""
    answer = "\nplan</think>\n\nred"
    plain = completion_body(_summary(answer), "m", created=1)
    unset = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
    assert plain["choices"][0]["message"] == {
        "role": "assistant", "content": answer, **unset, "reasoning": None, "reasoning_content": None
    }  # fmt: skip
    assert list(plain["choices"][0]["message"]) == [
        "role", "content", "refusal", "annotations", "audio", "function_call", "reasoning", "reasoning_content"
    ]  # fmt: skip
    parted = _parted(answer, thinking=True)
    assert parted["choices"][0]["message"] == {
        "role": "assistant",
        "content": "\n\nred",
        **unset,
        "reasoning": "\nplan",
        "reasoning_content": "\nplan",
    }
    # every generated token counts, the reasoning's too
    assert parted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    hidden = _parted(answer, thinking=True, include_reasoning=False)
    assert hidden["choices"][0]["message"] == {
        "role": "assistant",
        "content": "\n\nred",
        **unset,
        "reasoning": None,
        "reasoning_content": None,
    }
    cut = _parted("still thinking", thinking=True)["choices"][0]
    assert (cut["message"]["content"], cut["message"]["reasoning"]) == (None, "still thinking")
    off = _parted("a</think>b", thinking=False)["choices"][0]
    assert (off["message"]["content"], off["message"]["reasoning"]) == ("a</think>b", None)
    echoed = _parted("x</think>y", echoed="I said: ", thinking=True)
    assert echoed["choices"][0]["message"]["content"] == "I said: y"  # an echo leads the content


def _parse(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(body, "m", SamplingOptions(), GenerationConfig(max_new_tokens=8))


def test_include_reasoning_is_read_not_refused():
    """It was refused unless true (no parser could leave the reasoning out)."""
    assert _parse().include_reasoning and not _parse(include_reasoning=False).include_reasoning
    assert not _parse(include_reasoning="no").include_reasoning  # vLLM's bool: "no" is false
    with pytest.raises(InvalidRequest, match="include_reasoning"):
        _parse(include_reasoning="hidden")


def test_the_config_takes_vllms_parser_names_only():
    assert HttpApiConfig(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="--reasoning-parser must be one of qwen3, deepseek_r1, got 'r1'"):
        HttpApiConfig(reasoning_parser="r1")


def test_under_a_parser_a_chat_requests_constraint_starts_after_the_reasoning():
    spec = StructuredOutputs(regex="a")
    generation = constrained_after_reasoning(GenerationConfig(structured_outputs=spec))
    assert generation.structured_outputs == StructuredOutputs(regex="a", after_reasoning=True)
    assert constrained_after_reasoning(GenerationConfig()) == GenerationConfig()  # none: nothing to start


THINK, END = 7, 8
"""The think markers' token ids in these tests (`marker_ids`: prefill reports the model's)."""
QWEN3_IDS = MarkerIds(THINK, END)
"""Counted as `--reasoning-parser qwen3` counts: to the first `</think>`."""


@pytest.mark.parametrize(
    ("thinking", "steps", "want"),
    [
        (False, [("a", [1]), ("</think>", [END]), ("b", [2])], 0),  # thinking off
        (
            True,
            [("a", [1, 2]), ("</think>", [END]), ("b", [3]), ("c", [4])],
            2,
        ),  # the marker's token does not count
        (
            True,
            [("<think>", [THINK]), ("a", [1]), ("</think>", [END]), ("b", [2])],
            1,
        ),  # nor the model's <think>
        (True, [("a", [1]), ("<think>", [THINK])], 1),  # the model's <think>, held, then the answer cut
        (True, [("a", [1]), ("b", [2])], 2),  # cut inside the block: all reasoning
        # content tokens after </think>'s in the same step: not reasoning (by text: 2 + 3 - 1 = 4)
        (True, [("a", [1, 2]), ("</think>bc", [END, 3, 4])], 2),
        # a stop string that begins with "</think>" makes decode send the marker's text late, with the
        # content token after it (by text: 3 + 1 = 4, the marker's token and more counted)
        (True, [("P", [1]), ("P", [1]), ("P", [1]), ("", [END]), ("</think>Q", [2]), ("R", [3])], 3),
        # the text's marker cut anywhere: the token decides (by text: 2 + 2 - 1 = 3)
        (True, [("a</thi", [1, END]), ("nk>b", [2, 3]), ("c", [4])], 1),
        # "</think>" spelled in pieces is no marker token: vLLM counts on, as its id never came
        (True, [("a</", [1, 2]), ("think>b", [3, 4])], 4),
    ],
)
def test_reasoning_tokens_are_counted_by_token_id_as_vllms(thinking, steps, want):
    """vLLM counts reasoning_tokens (the Responses API's, and chat's) by token id between <think>
    (or the answer's start, a block the prompt opened) and </think>, the markers left out, however
    the text of those tokens comes; the stream that parts the text counts them in the same pass,
    and a whole answer's steps (`part_answers`) the same."""
    stream = ReasoningStream(thinking, lambda: QWEN3_IDS)
    for text, token_ids in steps:
        stream.add(text, token_ids)
    stream.finish()
    assert stream.num_reasoning_tokens == want
    whole = part_answers([(0, text, ids) for text, ids in steps], thinking, lambda: QWEN3_IDS)
    assert whole.num_reasoning_tokens == want


@pytest.mark.parametrize(
    ("steps", "qwen3", "deepseek_r1"),
    [
        # a second block after the first's </think>: its tokens, not its markers', count for deepseek_r1
        (
            [("a", [1, 2]), ("</think>", [END]), ("b", [3]), ("<think>", [THINK]), ("c", [4, 5]),
             ("</think>", [END]), ("d", [6])],
            2,
            2 + 2,
        ),
        # nested in it: open until its own </think>
        (
            [("a", [1]), ("</think>", [END]), ("<think>", [THINK]), ("<think>", [THINK]), ("x", [2]),
             ("</think>", [END]), ("y", [3]), ("</think>", [END]), ("z", [4])],
            1,
            1 + 2,
        ),
        # the model's own <think> in the block the template opened is that block's, opens no other
        ([("<think>", [THINK]), ("a", [1]), ("</think>", [END]), ("b", [2])], 1, 1),
        # a block opened again and cut by max_tokens: counted to the end
        ([("a", [1]), ("</think>", [END]), ("<think>", [THINK]), ("c", [2, 3])], 1, 1 + 2),
    ],
)  # fmt: skip
def test_a_block_the_model_opens_again_is_counted_as_its_parser_counts_it_in_vllm(steps, qwen3, deepseek_r1):
    """The model writes `<think>` again after its `</think>`: vLLM's deepseek_r1 counts that block's
    tokens too (`BaseThinkingReasoningParser.count_reasoning_tokens`, a depth counter), its qwen3
    does not (its grammar leaves reasoning at the first `</think>` for good). The text is parted
    alike: the block the template opened is the reasoning, all after its `</think>` content."""
    for later_blocks, want in ((False, qwen3), (True, deepseek_r1)):
        read_ids = functools.partial(MarkerIds, THINK, END, later_blocks)
        stream = ReasoningStream(True, read_ids)
        for text, token_ids in steps:
            stream.add(text, token_ids)
        stream.finish()
        assert stream.num_reasoning_tokens == want
        whole = part_answers([(0, text, token_ids) for text, token_ids in steps], True, read_ids)
        assert whole.num_reasoning_tokens == want
        assert whole.split(0) == split_reasoning("".join(text for text, _ in steps), True)


@pytest.mark.parametrize(
    ("thinking", "steps", "want"),
    [
        (False, [("a", 1), ("</think>", 1), ("b", 1)], 0),  # thinking off
        (True, [("a", 2), ("</think>", 1), ("b", 1), ("c", 1)], 2),  # the marker's token does not count
        (True, [("<think>", 1), ("a", 1), ("</think>", 1), ("b", 1)], 1),  # nor the model's own <think>
        (True, [("a", 1), ("<think>", 1)], 1),  # the model's <think>, held, then the answer cut
        (True, [("a</thi", 2), ("nk>b", 2), ("c", 1)], 3),  # a marker split across steps: one token
        (True, [("a", 1), ("b", 1)], 2),  # cut inside the block: all reasoning
    ],
)
def test_without_the_markers_ids_reasoning_tokens_are_counted_by_where_the_text_falls(thinking, steps, want):
    """Prefill has not reported the markers' ids (no model info yet, an older prefill): a step's
    tokens count while its text is the reasoning's, each marker its text completes one token that
    does not count."""
    stream = ReasoningStream(thinking)
    for text, num_tokens in steps:
        stream.add(text, list(range(num_tokens)))
    stream.finish()
    assert stream.num_reasoning_tokens == want


def test_the_markers_ids_are_those_prefill_reports_when_every_replica_agrees():
    info = ModelInfo(1024, 4096, 4096, 512, "qwen3_5", reasoning_markers=("<think>", "</think>"))
    assert marker_ids(None, "qwen3") is None and marker_ids(info, "qwen3") is None  # not known: by the text
    known = replace(info, reasoning_marker_ids=(THINK, END))
    assert marker_ids(known, "qwen3") == QWEN3_IDS
    assert marker_ids(known, "deepseek_r1") == MarkerIds(THINK, END, later_blocks=True)
    one_marker = replace(known, reasoning_markers=("</think>",), reasoning_marker_ids=(END,))
    assert marker_ids(one_marker, "qwen3") is None
    assert marker_ids(common_model_info([known, known]), "qwen3") == QWEN3_IDS
    assert (
        marker_ids(common_model_info([known, replace(known, reasoning_marker_ids=(1, 2))]), "qwen3") is None
    )
    assert marker_ids(common_model_info([known, info]), "qwen3") is None  # one replica from before the ids


STEPS = [
    (0, "a", [1]),
    (1, "x", [1, 2]),
    (0, "</think>", [END]),
    (1, "y", [3]),
    (0, "b", [4]),
    (1, "</think>", [END]),
    (1, "z", [5]),
]
"""Two choices' steps (choice index, text, token ids), interleaved."""


@pytest.mark.parametrize("ids", [QWEN3_IDS, None])
def test_chats_reasoning_tokens_are_each_choices_summed_and_reported_only_with_a_parser(ids):
    """vLLM's chat usage (`completion_tokens_details.reasoning_tokens`, with a reasoning parser):
    each choice's count, its steps interleaved with the other's, summed; no field without one."""
    assert part_answers(STEPS, thinking=True, read_marker_ids=lambda: ids).num_reasoning_tokens == 1 + 3
    assert part_answers(STEPS, thinking=False, read_marker_ids=lambda: ids).num_reasoning_tokens == 0
    cut = [(0, "a", [1]), (0, "<think>", [THINK])]
    assert part_answers(cut, thinking=True, read_marker_ids=lambda: ids).num_reasoning_tokens == 1  # dropped
    assert "completion_tokens_details" not in completion_body(_summary("a"), "m")["usage"]


def test_a_whole_chat_answer_is_parted_and_counted_in_one_pass_over_its_steps(monkeypatch):
    """A whole chat answer under a reasoning parser goes through each choice's `ReasoningStream`
    once, step by step, as a stream does and as the Responses answer does: that one pass parts
    the text and counts the reasoning tokens (the text was parted a second time, whole)."""
    parts: list[str] = []
    split = ReasoningStream._split

    def counted(self, text):
        parts.append(text)
        return split(self, text)

    monkeypatch.setattr(ReasoningStream, "_split", counted)
    summary = _summary("a</think>b")
    summary.choices = [
        ChoiceSummary(0, "a</think>b", [1, 2, 3], "stop"),
        ChoiceSummary(1, "xy</think>z", [4, 5, 6, 7, 8], "stop"),
    ]
    steps = [TokenStep(ids, text, index=index) for index, text, ids in STEPS]
    body = completion_body(
        summary, "m", created=1, thinking=True, steps=steps, read_marker_ids=lambda: QWEN3_IDS
    )
    # each step's text once while it thinks; after </think> a step is content as it comes
    assert parts == ["a", "x", "</think>", "y", "</think>"]
    messages = [(c["message"]["reasoning"], c["message"]["content"]) for c in body["choices"]]
    assert messages == [("a", "b"), ("xy", "z")]
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1 + 3}
    with pytest.raises(ValueError, match="from its token steps"):
        completion_body(summary, "m", thinking=True)
