"""`epd ask --chat-template FILE_OR_TEMPLATE` as a user runs it (embedded: the model it loads renders
the prompt with that template, and the answer is generate()'s on the processor's rendering with
it); a template that does not parse exits 2 saying what to change (the flag against a gateway:
test_cli_ignored_flags)."""

from __future__ import annotations

import json

from tests.chat_templates import OVERRIDE
from tests.reference import template_reference
from tests.stack import run_epd_forked

QUESTION = "name a colour"


def test_ask_renders_the_prompt_with_the_given_template(tiny_models, tmp_path):
    model = tiny_models["qwen2_vl"]
    template = tmp_path / "override.jinja"
    template.write_text(OVERRIDE)
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    prompt_ids, want = template_reference(model, messages, 12, chat_template=OVERRIDE)
    assert prompt_ids != template_reference(model, messages, 1)[0]
    proc = run_epd_forked(
        "ask", "--no-video", QUESTION, "--max-new-tokens", "12", "--json", "--model", str(model),
        "--chat-template", str(template),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == want and out["num_prompt_tokens"] == len(prompt_ids)


def test_ask_refuses_a_template_it_cannot_use_saying_what_to_change(tmp_path):
    for args, says in (
        (
            ["--chat-template", "{% if messages %}"],
            "--chat-template: the chat template does not parse: line 1: ",
        ),
        (["--chat-template", str(tmp_path / "missing.jinja")], "is not a file that can be read"),
    ):
        refused = run_epd_forked("ask", "--no-video", QUESTION, *args)
        assert refused.returncode == 2 and says in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
