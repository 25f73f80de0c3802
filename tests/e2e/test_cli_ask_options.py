"""`epd ask`'s options beyond a question about a video, in subprocesses, embedded and against a
stack (the session's `shared_stack`): --prompt (a raw prompt), --logprobs and --prompt-logprobs,
--timeout (each question's deadline), the chat-template flags, --structured-outputs-config
embedded, the SDK's own checks against --endpoint; each refusal says what to change."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.cli_runs import QUESTION
from tests.stack import run_epd_forked


def test_ask_endpoint_says_which_flag_the_sdk_refuses():
    """Against --endpoint, a value the SDK's own checks refuse before any call is a usage error
    (exit 2) saying what to change; it was "INTERNAL: internal error; the server log has details",
    with no server involved (nothing listens on port 9: the check comes before connecting)."""
    for flags, says in (
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--max-new-tokens", "-3"], "max_new_tokens must be >= 1"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--logprobs", "-1"], "logprobs must be >= 0"),
    ):
        refused = run_epd_forked("ask", "--no-video", QUESTION, "--endpoint", "127.0.0.1:9", *flags)
        assert refused.returncode == 2 and says in refused.stderr, (flags, refused.stderr)
        assert "INTERNAL" not in refused.stderr and "Traceback" not in refused.stderr


def test_ask_timeout_is_each_questions_deadline_through_the_stack_too(media_files, shared_stack):
    """`epd ask --endpoint ... --timeout S`: S is each question's gRPC deadline (the SDK's
    timeout_s, which the gateway passes on to the stages); past it, one line says what to raise
    and the exit status is 124, as embedded (`test_clean_exit`), not the SDK's "raise timeout_s"
    with exit 1. A deadline of 1 ms passes before the request is through, whatever the machine;
    one of 5 minutes does not cut an answer."""
    ask = ["ask", str(media_files["mp4"]), QUESTION, "--endpoint", shared_stack.gateway, "--num-frames", "4",
           "--max-new-tokens", "4", "--json"]  # fmt: skip
    late = run_epd_forked(*ask, "--timeout", "0.001")
    assert late.returncode == 124, late.stderr
    assert late.stderr.splitlines()[-1].startswith(
        "epd: no answer within 0.001 s (--timeout): raise --timeout"
    )
    assert late.stdout == "" and "Traceback" not in late.stderr
    answered = run_epd_forked(*ask, "--timeout", "300")
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout)["finish_reason"] in ("stop", "length")


RAW_PROMPT = "Once upon a time, in a land far away,"


def test_ask_prompt_continues_a_raw_prompt_embedded_and_through_the_stack(tiny_models, shared_stack):
    """`epd ask --prompt TEXT`: no chat template, no media (no encoder: no video_decode or encode
    time), the tokens `model.generate(tokenizer(TEXT).input_ids, do_sample=False)` gives, embedded
    and against a gateway (--endpoint, the SDK's `prompt=`) alike."""
    from tests.reference import raw_reference

    model = str(tiny_models["qwen2_vl"])
    ids, want = raw_reference(model, RAW_PROMPT, 12)
    assert len(set(want)) > 2, "the tiny model repeats one token; the comparison would prove little"
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, *where, "--max-new-tokens", "12", "--json")
        assert proc.returncode == 0, (where, proc.stderr)
        out = json.loads(proc.stdout)
        assert out["token_ids"] == want, where
        assert out["num_prompt_tokens"] == len(ids) and out["num_visual_tokens"] == 0, where
        assert out["timings_ms"]["encode"] == 0.0 and out["timings_ms"]["video_decode"] == 0.0, where
    proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, "--model", model, "--max-new-tokens", "4")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr  # the text answer, as a question's


def test_ask_logprobs_embedded_and_through_the_stack(tiny_models, shared_stack):
    """`epd ask --logprobs K --prompt-logprobs K`: the result's logprobs (--json), one per answer
    token with its K alternatives, and one per prompt token (the first with none), the same
    numbers embedded and against a gateway; as text, a table after the answer, a row per token.
    More than the server's --max-logprobs is the server's INVALID_ARGUMENT."""
    model = str(tiny_models["qwen2_vl"])
    flags = ["--max-new-tokens", "6", "--logprobs", "2", "--prompt-logprobs", "1"]
    outs = []
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, *where, *flags, "--json")
        assert proc.returncode == 0, (where, proc.stderr)
        out = json.loads(proc.stdout)
        assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"], where
        assert all(len(lp["top"]) == 2 for lp in out["logprobs"]), where
        assert len(out["prompt_logprobs"]) == out["num_prompt_tokens"] and out["prompt_logprobs"][0] is None
        assert all(len(lp["top"]) == 1 and lp["rank"] >= 1 for lp in out["prompt_logprobs"][1:]), where
        outs.append(out)
    embedded, remote = outs
    assert embedded["token_ids"] == remote["token_ids"]
    for name in ("logprobs", "prompt_logprobs"):
        numbers = [[lp and lp["logprob"] for lp in out[name]] for out in outs]
        assert numbers[0][1:] == pytest.approx(numbers[1][1:], abs=1e-4), name

    proc = run_epd_forked("ask", "--prompt", RAW_PROMPT, "--endpoint", shared_stack.gateway, *flags)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("logprobs of the answer's tokens (6; top 2 at each position):")
    rows = lines[start + 2 : start + 8]
    assert [row.split()[1] for row in rows] == [repr(lp["token"]).split()[0] for lp in remote["logprobs"]]
    assert (
        f"logprobs of the prompt's tokens ({remote['num_prompt_tokens']}; top 1 at each position):" in lines
    )

    refused = run_epd_forked(
        "ask", "--prompt", RAW_PROMPT, "--endpoint", shared_stack.gateway, "--logprobs", "21"
    )
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
    assert "between 0 and 20 (--max-logprobs)" in refused.stderr


def test_ask_prompt_with_a_video_or_a_question_is_refused_saying_what_to_drop(media_files, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    for args, says in (
        ([str(media_files["mp4"]), "--prompt", "x"], "drop a VIDEO or QUESTION argument"),
        ([str(media_files["mp4"]), QUESTION, "--prompt", "x"], "drop a VIDEO or QUESTION argument"),
        (["--prompt", "x", "--messages", str(messages)], "drop --messages"),
        (["--prompt", "x", "--question", QUESTION], "drop --question"),
        (["--prompt", "x", "--no-video"], "drop --no-video"),
        (["--prompt", ""], "--prompt is empty"),
    ):
        refused = run_epd_forked("ask", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr


# A text-only conversation ending with the assistant's (partial) answer, the processor's chat form.
ASSISTANT_LAST = [
    {"role": "user", "content": [{"type": "text", "text": "name a colour"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]},
]


def test_ask_continue_final_message_continues_the_assistants_message(tiny_models, shared_stack, tmp_path):
    """`epd ask --messages FILE --continue-final-message` (FILE ending with the assistant's message):
    generate()'s tokens on `apply_chat_template(add_generation_prompt=False, continue_final_message=True)`
    (the flag implies the first), embedded and against a gateway (the SDK's keyword options);
    `--no-add-generation-prompt` alone renders without a new answer's opening. Without the flags,
    an answer after the assistant's message, which differs (so the flags are what is tested)."""
    from tests.reference import template_reference

    model = str(tiny_models["qwen2_vl"])
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(ASSISTANT_LAST))
    continued = template_reference(
        model, ASSISTANT_LAST, 12, add_generation_prompt=False, continue_final_message=True
    )
    closed = template_reference(model, ASSISTANT_LAST, 12, add_generation_prompt=False)
    after = template_reference(model, ASSISTANT_LAST, 12)
    assert len({tuple(continued[1]), tuple(closed[1]), tuple(after[1])}) == 3, (
        "the three renderings answer alike"
    )
    ask = ["ask", "--no-video", "--messages", str(path), "--max-new-tokens", "12", "--json"]
    for where in (["--model", model], ["--endpoint", shared_stack.gateway]):
        for flags, (prompt_ids, want) in (
            (["--continue-final-message"], continued),
            (["--no-add-generation-prompt"], closed),
            ([], after),
        ):
            proc = run_epd_forked(*ask, *flags, *where)
            assert proc.returncode == 0, (where, flags, proc.stderr)
            out = json.loads(proc.stdout)
            assert out["token_ids"] == want and out["num_prompt_tokens"] == len(prompt_ids), (where, flags)


def test_ask_template_flags_without_messages_are_refused_saying_what_to_change(tmp_path):
    user_last = tmp_path / "messages.json"
    user_last.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    give = "give --messages FILE (ending with the assistant's message to continue it), or drop"
    for args, says in (
        (["--no-video", QUESTION, "--continue-final-message"], f"{give} --continue-final-message"),
        (["--no-video", QUESTION, "--no-add-generation-prompt"], f"{give} --no-add-generation-prompt"),
        (["--prompt", "x", "--continue-final-message"], f"{give} --continue-final-message"),
        (
            ["--no-video", "--messages", str(user_last), "--continue-final-message"],
            "end with the assistant's message to continue",
        ),
    ):
        refused = run_epd_forked("ask", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr


def test_ask_structured_outputs_config_holds_the_embedded_answer_to_no_free_whitespace(tiny_models):
    """Embedded `epd ask --structured-outputs-config` (or its dotted form), as the server's front
    door applies it: a JSON constraint's answer has no whitespace outside its strings, where the
    tiny model pads the same request's JSON with whitespace without it."""
    ask = ["ask", "--no-video", QUESTION, "--model", str(tiny_models["qwen2_vl"]), "--json-object",
           "--max-new-tokens", "24", "--json"]  # fmt: skip

    def free_whitespace(*flags: str) -> bool:
        proc = run_epd_forked(*ask, *flags)
        assert proc.returncode == 0, (flags, proc.stderr)
        answer = json.loads(proc.stdout)["answer"]
        assert answer.startswith("{"), (flags, answer)
        return bool(re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', answer)))

    assert free_whitespace(), "the tiny model pads no more: the test would prove nothing"
    assert not free_whitespace("--structured-outputs-config", '{"disable_any_whitespace": true}')
    assert not free_whitespace("--structured-outputs-config.disable_any_whitespace", "true")
