"""The structured-outputs cases that several integration test files send (test_structured_outputs,
test_structured_outputs_config, test_structured_gateway, test_structured_early_compile,
test_responses_api): the question, the JSON schema, regex and choices as vLLM's request fields
(`CASES`), their references on the unsplit model (`masked_references`: generate() with xgrammar's
own matcher as a LogitsProcessor), the chat request that asks for them and the check that an
answer keeps to its constraint."""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.request

import torch
import xgrammar as xgr
from transformers import LogitsProcessor, LogitsProcessorList

from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
from tests.reference import reference_tokens

QUESTION = "list the objects as JSON"
NUM_FRAMES = 4
MAX_TOKENS = 64  # the tiny vocabulary spells JSON a character or two per token
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "moving": {"type": "boolean"},
        "count": {"enum": [1, 2, 3]},
    },
    "required": ["colour", "moving", "count"],
    "additionalProperties": False,
}
REGEX = "(red|green|blue) (circle|square)"
CHOICES = ["a red circle", "two squares", "nothing"]
SLOW_REGEX = "[a-z]*" * 10000
"""A regex xgrammar takes seconds to compile (about 2.7 s on a quiet core of the 2-core VM, on the
tiny vocabulary; the time grows with the square of the repeats: 5000 took 0.65 s, too close to
the tests' TIMEOUT_S of 0.5 s for the compile to be sure to outlive the next request), within the
64 KiB a spec may have."""

# (the HTTP body's fields, the reference's grammar as xgrammar compiles it, whether it completes
# within MAX_TOKENS: JSON with free whitespace may not, on a random model)
CASES = {
    "json_schema": (
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
    ),
    "response_format": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "objects", "schema": SCHEMA}}},
        lambda c: c.compile_json_schema(json.dumps(SCHEMA)),
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, lambda c: c.compile_json_schema('{"type": "object"}')),
    "regex": ({"guided_regex": REGEX}, lambda c: c.compile_regex(REGEX)),
    "choice": ({"guided_choice": CHOICES}, lambda c: c.compile_grammar('root ::= "a red circle" | "two squares" | "nothing"')),
}  # fmt: skip


class GrammarMask(LogitsProcessor):
    """The reference: xgrammar's matcher on the unsplit model's generate(). input_ids [1, prompt +
    generated], scores [1, vocab]: every token the grammar does not allow next at -inf."""

    def __init__(self, compiled, num_prompt_tokens: int, vocab_size: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_prompt_tokens = num_prompt_tokens
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.num_prompt_tokens:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, self.bitmask, vocab_size=scores.shape[-1])
        return scores


def masked_references(model_dir, video, cases: list[str]) -> dict[str, list[int]]:
    """`cases`' reference tokens on the unsplit model at `model_dir`, and the plain greedy ones
    ("plain")."""
    model, processor = whole_model(model_dir)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    eos = model.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(
        processor.tokenizer, vocab_size=vocab_size, stop_token_ids=eos if isinstance(eos, list) else [eos]
    )
    compiler = xgr.GrammarCompiler(info)
    num_prompt = reference_inputs(processor, video, question_message(video, QUESTION))["input_ids"].shape[1]
    refs = {"plain": reference_tokens(model_dir, video, QUESTION, MAX_TOKENS)}
    for name in cases:
        mask = GrammarMask(CASES[name][1](compiler), num_prompt, vocab_size)
        refs[name] = reference_tokens(
            model_dir, video, QUESTION, MAX_TOKENS, logits_processor=LogitsProcessorList([mask])
        )
        assert refs[name] != refs["plain"][: len(refs[name])], f"{name}: the constraint changes nothing here"
    return refs


def chat_request(port: int, media_files, **fields) -> urllib.request.Request:
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    body = {"model": "epd", "max_tokens": MAX_TOKENS, "media": {"num_frames": NUM_FRAMES}, "return_token_ids": True,
            **fields,
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": QUESTION}]}]}  # fmt: skip
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )


def chat(port: int, media_files, **fields) -> tuple[int, dict]:
    request = chat_request(port, media_files, **fields)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def check_text(name: str, text: str) -> None:
    """The answer keeps to its constraint, read back as a client reads it."""
    if name in ("json_schema", "response_format"):
        value = json.loads(text)
        assert set(value) == {"colour", "moving", "count"}, value
        assert value["colour"] in ("red", "green", "blue") and isinstance(value["moving"], bool)
        assert value["count"] in (1, 2, 3)
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES
