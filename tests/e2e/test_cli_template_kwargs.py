"""`epd ask --chat-template-kwargs JSON` as a user runs it: the model's chat template renders the
question with those variables, embedded and against a gateway (the SDK's keyword option over
gRPC), and the answer is generate()'s on the processor's own rendering with them; a flag the
doors would refuse exits 2 saying what to change."""

from __future__ import annotations

import json

from tests.chat_templates import GENERATION_PROMPT, THINKING_PROMPT
from tests.reference import template_reference
from tests.stack import Stack, run_epd_forked

QUESTION = "name a colour"
NO_THINKING = '{"enable_thinking": false}'


def test_ask_passes_the_variables_to_the_chat_template(tiny_models, tmp_path):
    """The tiny Qwen2-VL with Qwen3.5's thinking generation prompt: with the flag, the prompt
    closes the thinking block (another prompt than without it), in one process and through the
    stack, each answer generate()'s on its own rendering; a conversation's turn too."""
    import shutil

    model = tmp_path / "thinking"
    shutil.copytree(tiny_models["qwen2_vl"], model)
    template = model / "chat_template.jinja"
    template.write_text(template.read_text().replace(GENERATION_PROMPT, THINKING_PROMPT))
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    closed = template_reference(model, messages, 12, enable_thinking=False)
    opened = template_reference(model, messages, 12)
    assert closed[0] != opened[0]
    ask = ["ask", "--no-video", QUESTION, "--max-new-tokens", "12", "--json"]
    with Stack(model, tmp_path / "logs") as stack:
        for where in (["--model", str(model)], ["--endpoint", stack.gateway]):
            for flags, (prompt_ids, want) in (
                (["--chat-template-kwargs", NO_THINKING], closed),
                ([], opened),
            ):
                proc = run_epd_forked(*ask, *flags, *where)
                assert proc.returncode == 0, (where, flags, proc.stderr)
                out = json.loads(proc.stdout)
                assert out["token_ids"] == want and out["num_prompt_tokens"] == len(prompt_ids), (
                    where,
                    flags,
                )
            # A conversation's turns (--question) carry them too.
            proc = run_epd_forked(
                "ask", "--no-video", "--question", QUESTION, "--max-new-tokens", "12", "--json",
                "--chat-template-kwargs", NO_THINKING, *where,
            )  # fmt: skip
            assert proc.returncode == 0, (where, proc.stderr)
            assert json.loads(proc.stdout.splitlines()[0])["token_ids"] == closed[1], where


def test_ask_refuses_variables_no_door_takes_saying_what_to_change():
    for args, says in (
        (["--prompt", "x", "--chat-template-kwargs", NO_THINKING], "--prompt has no template: drop one"),
        (
            ["--no-video", QUESTION, "--chat-template-kwargs", "{enable_thinking}"],
            "is not JSON; give an object",
        ),
        (
            ["--no-video", QUESTION, "--chat-template-kwargs", "[1]"],
            "'chat_template_kwargs' must be an object",
        ),
        (
            ["--no-video", QUESTION, "--chat-template-kwargs", '{"add_generation_prompt": false}'],
            "chat_template_kwargs cannot set 'add_generation_prompt'",
        ),
    ):
        refused = run_epd_forked("ask", *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr
