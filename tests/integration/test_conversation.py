"""The SDK's conversations against the shared real stack: three turns whose tokens each equal
`model.generate(do_sample=False)` on the processor's chat template of the whole conversation so
far (earlier answers as assistant turns), the history as sent, the media uploaded once and then
reused by sha256; the asyncio client's streamed conversation gives the same turns."""

from __future__ import annotations

import asyncio

import pytest

from epd.client import VIDEO, AskResult, AsyncEpdClient, EpdClient, Message, TokenDelta
from tests.reference import decode_for_test, reference_tokens_for_messages

NUM_FRAMES = 4
MAX_NEW_TOKENS = 8
QUESTIONS = ["how many objects are there?", "which appears first?", "what colour is it?"]
OPTIONS = {"num_frames": NUM_FRAMES, "max_new_tokens": MAX_NEW_TOKENS}


def chat_form(questions: list[str], answers: list[str]) -> list[dict]:
    """The processor's form of the conversation the references are generated from."""
    out: list[dict] = []
    for i, question in enumerate(questions):
        content = [{"type": "text", "text": question}]
        out.append({"role": "user", "content": ([{"type": "video"}] if i == 0 else []) + content})
        if i < len(answers):
            out.append({"role": "assistant", "content": [{"type": "text", "text": answers[i]}]})
    return out


@pytest.fixture(scope="module")
def client(shared_stack):
    with EpdClient(shared_stack.gateway, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def conversation(client, media_files) -> tuple[list[AskResult], list[Message]]:
    chat = client.conversation(media_files["mp4"], **OPTIONS)
    results = [chat.ask(q) for q in QUESTIONS]
    assert chat.results == results
    return results, chat.history


@pytest.fixture(scope="module")
def turns(conversation) -> list[AskResult]:
    return conversation[0]


def test_each_turn_equals_generate_on_the_whole_conversation(turns, tiny_models, media_files):
    video = decode_for_test(media_files["mp4"], NUM_FRAMES)
    answers = [r.answer for r in turns]
    for k in range(len(QUESTIONS)):
        messages = chat_form(QUESTIONS[: k + 1], answers[:k])
        want = reference_tokens_for_messages(tiny_models["qwen2_vl"], video, messages, MAX_NEW_TOKENS)
        assert turns[k].token_ids == want, f"turn {k + 1}"
    # Otherwise the equality above would not show that the history reached the model.
    alone = reference_tokens_for_messages(tiny_models["qwen2_vl"], video, chat_form(QUESTIONS[1:2], []),
                                          MAX_NEW_TOKENS)  # fmt: skip
    assert alone != turns[1].token_ids


def test_the_history_is_the_questions_and_answers(conversation):
    turns, history = conversation
    a1, a2, a3 = (r.answer for r in turns)
    q1, q2, q3 = QUESTIONS
    assert history == [
        Message.user(VIDEO, q1), Message.assistant(a1),
        Message.user(q2), Message.assistant(a2),
        Message.user(q3), Message.assistant(a3),
    ]  # fmt: skip
    # Each turn's prompt holds the one before it and its answer: it only grows.
    assert turns[0].num_prompt_tokens < turns[1].num_prompt_tokens < turns[2].num_prompt_tokens
    for r in turns:
        assert getattr(r, "num_reused_prompt_tokens", 0) < r.num_prompt_tokens


def test_the_media_goes_up_once_then_by_sha256(turns, media_files):
    assert turns[0].media_num_bytes_sent == media_files["mp4"].stat().st_size
    assert [r.media_num_bytes_sent for r in turns[1:]] == [0, 0]
    assert all(r.encoder_cache_hit for r in turns[1:])
    assert len({r.media_sha256 for r in turns}) == 1


def test_a_failed_turn_leaves_the_history_and_reset_starts_over(client, media_files, turns):
    from epd.client import EpdError

    chat = client.conversation(media_files["mp4"], **OPTIONS)
    first = chat.ask(QUESTIONS[0])
    assert first.token_ids == turns[0].token_ids
    with pytest.raises(EpdError, match="unknown pruning preset"):
        chat.ask(QUESTIONS[1], pruning="no-such-preset")
    assert chat.history == [Message.user(VIDEO, QUESTIONS[0]), Message.assistant(first.answer)]
    # The stream form: deltas, then the result, and the turn joins the history.
    items = list(chat.stream(QUESTIONS[1]))
    assert isinstance(items[-1], AskResult) and items[-1].token_ids == turns[1].token_ids
    assert "".join(i.text for i in items if isinstance(i, TokenDelta)) == items[-1].answer
    assert len(chat.history) == 4
    chat.reset()
    assert chat.history == [] and chat.results == []
    chat.ask(QUESTIONS[1])
    assert chat.history[0] == Message.user(VIDEO, QUESTIONS[1])  # a fresh first turn, with the video


def test_the_async_client_streams_the_same_conversation(shared_stack, media_files, turns):
    async def run() -> list[AskResult]:
        async with AsyncEpdClient(shared_stack.gateway, timeout_s=120) as client:
            chat = client.conversation(media_files["mp4"], **OPTIONS)
            out = []
            for question in QUESTIONS[:2]:
                out += [item async for item in chat.stream(question) if isinstance(item, AskResult)]
            assert len(chat.history) == 4
            return out

    assert [r.token_ids for r in asyncio.run(run())] == [r.token_ids for r in turns[:2]]


def test_epd_ask_with_repeated_questions_against_the_gateway_gives_the_same_turns(
    shared_stack, media_files, turns
):
    """`epd ask VIDEO Q1 --question Q2 --question Q3 --endpoint GATEWAY --json`: one JSON line per
    turn, the same tokens as the SDK conversation above (the CLI uses it), follow-ups reusing the
    earlier turns' prefill."""
    import json
    import subprocess

    from tests.stack import ROOT, child_env, epd_command

    args = [
        "ask",
        str(media_files["mp4"]),
        QUESTIONS[0],
        *[x for q in QUESTIONS[1:] for x in ("--question", q)],
        "--endpoint",
        shared_stack.gateway,
        "--json",
        "--num-frames",
        str(NUM_FRAMES),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
    ]
    proc = subprocess.run(
        epd_command(*args), capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [line["question"] for line in lines] == QUESTIONS
    assert [line["token_ids"] for line in lines] == [r.token_ids for r in turns]
    assert all(line["num_reused_prompt_tokens"] > 0 for line in lines[1:])
