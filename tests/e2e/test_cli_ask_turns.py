"""`epd ask` conversations, in subprocesses: --question in turns and --interactive (one process, one
pipeline, each turn prompted with the earlier questions and answers: generate()'s tokens), a
text-only conversation (--no-video), and what they cannot be combined with."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cli_runs import QUESTION, run_epd
from tests.reference import decode_for_test, reference_tokens_for_messages
from tests.stack import run_epd_forked

FOLLOW_UP = "which appears first?"


def _conversation_reference(model_dir, media_path, questions: list[str]) -> tuple[list[list[int]], list[str]]:
    """generate()'s tokens and text for each turn of `questions` asked in turn, each prompted with
    the earlier questions and answers (the processor's chat form), as epd sends them."""
    from transformers import AutoProcessor

    tokenizer = AutoProcessor.from_pretrained(model_dir).tokenizer
    video = decode_for_test(media_path, 8)
    ids: list[list[int]] = []
    answers: list[str] = []
    messages: list[dict] = []
    for i, question in enumerate(questions):
        content = [{"type": "text", "text": question}]
        messages.append({"role": "user", "content": ([{"type": "video"}] if i == 0 else []) + content})
        ids.append(reference_tokens_for_messages(model_dir, video, messages, 12))
        answers.append(tokenizer.decode(ids[-1], skip_special_tokens=True))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[-1]}]})
    return ids, answers


@pytest.fixture(scope="module")
def conversation_reference(tiny_models, media_files):
    return _conversation_reference(tiny_models["qwen2_vl"], media_files["mp4"], [QUESTION, FOLLOW_UP])


def test_ask_embedded_questions_in_turns_are_one_conversation(
    tiny_models, media_files, conversation_reference
):
    """--question twice: one process, one pipeline; the second turn carries the first answer."""
    ids, answers = conversation_reference
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        "--question",
        QUESTION,
        "--question",
        FOLLOW_UP,
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    turns = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and [t["question"] for t in turns] == [QUESTION, FOLLOW_UP]
    assert [t["token_ids"] for t in turns] == ids
    assert [t["answer"] for t in turns] == answers
    assert turns[1]["encoder_cache_hit"], "the pipeline (and its caches) outlived the first turn"
    assert turns[1]["num_prompt_tokens"] > turns[0]["num_prompt_tokens"]


def test_ask_interactive_reads_questions_until_an_empty_line(
    tiny_models, media_files, conversation_reference
):
    _, answers = conversation_reference
    proc = run_epd_forked(
        "ask",
        str(media_files["mp4"]),
        "--interactive",
        "--model",
        str(tiny_models["qwen2_vl"]),
        "--num-frames",
        "8",
        "--max-new-tokens",
        "12",
        stdin=f"{QUESTION}\n{FOLLOW_UP}\n\nnot asked: after the empty line\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(f"{a}\n" for a in answers)
    assert sum(line.startswith("epd: 8 frames") for line in proc.stderr.splitlines()) == 2
    assert "not asked" not in proc.stderr


def test_ask_messages_cannot_be_combined_with_turns(media_files, tmp_path):
    path = tmp_path / "messages.json"
    path.write_text("[]")
    proc = run_epd("ask", str(media_files["mp4"]), "--messages", str(path), "--question", QUESTION)
    assert proc.returncode == 2 and "cannot be combined" in proc.stderr


def test_ask_no_video_is_a_text_only_conversation(tiny_models, tmp_path):
    """`epd ask --no-video QUESTION`: the question alone (no encoder: no video_decode or encode
    time), generate()'s tokens on it; with --question, a text-only conversation whose second turn
    reuses the first's prompt. Mixing it with a VIDEO or a media part is refused, saying what to change."""
    from tests.reference import text_only_reference

    model = str(tiny_models["qwen2_vl"])
    proc = run_epd_forked("ask", "--no-video", "hello, who are you?", "--question", "and then?", "--model", model,
                          "--max-new-tokens", "12", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first, second = (json.loads(line) for line in proc.stdout.strip().splitlines())
    question = [{"role": "user", "content": [{"type": "text", "text": "hello, who are you?"}]}]
    assert first["token_ids"] == text_only_reference(tiny_models["qwen2_vl"], question, 12)
    assert first["num_visual_tokens"] == 0 and first["timings_ms"]["encode"] == 0.0
    assert first["timings_ms"]["video_decode"] == 0.0 and second["num_reused_prompt_tokens"] > 0
    with_media = tmp_path / "messages.json"
    with_media.write_text(
        json.dumps([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "?"}]}])
    )
    for args, says in (
        (["--no-video", "samples/sample.mp4", QUESTION], "give the QUESTION alone"),
        ([QUESTION.replace(" ", "_")], "no such file"),
        (["--messages", str(with_media)], "give VIDEO, the path of a video or image"),
        (["--no-video", "--messages", str(with_media)], "give VIDEO instead of --no-video"),
    ):
        refused = run_epd_forked("ask", *args, "--model", model)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
