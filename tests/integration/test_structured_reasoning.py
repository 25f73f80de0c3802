"""Structured outputs under `--reasoning-parser qwen3`, through the real stack (four processes on
loopback) serving the tiny Qwen3.5, whose template opens a thinking block in the prompt: as vLLM's
(its default, `enable_in_reasoning` false), the grammar waits for the model's `</think>` and holds
for the tokens after it, or from the first token when the prompt closed the block
(`enable_thinking: false`). Every answer's tokens equal `generate()` on the unsplit model with a
reference LogitsProcessor built from xgrammar's own matcher that starts masking after `</think>`
(no epd code in it); `</think>` is made to come by a `logit_bias` on it, at the first token
(prefill's) or later (decode's), so the hand-off is crossed on either side of it. n choices and a
batch of such requests keep their own grammar states."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xgrammar as xgr
from transformers import LogitsProcessor, LogitsProcessorList

from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from tests.local_http import post_json
from tests.stack import Stack

MAX_TOKENS = 48
REGEX = "(red|blue) (circle|square)"
MESSAGES = [{"role": "user", "content": "name a shape"}]


class AfterReasoningMask(LogitsProcessor):
    """The reference: nothing masked until `end_id` has been generated (or from the start when
    `ended`), then every token xgrammar's matcher does not allow next at -inf; the matcher is fed
    the tokens after `end_id` alone. input_ids [1, prompt + generated], scores [1, vocab]."""

    def __init__(self, compiled, num_prompt_tokens: int, vocab_size: int, end_id: int, ended: bool) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.end_id, self.started, self.read = end_id, ended, num_prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for token in input_ids[0, self.read :].tolist():
            if self.started:
                assert self.matcher.accept_token(token)
            elif token == self.end_id:
                self.started = True
        self.read = input_ids.shape[1]
        if not self.started:
            return scores
        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, self.bitmask, vocab_size=scores.shape[-1])
        return scores


class Bias(LogitsProcessor):
    """logit_bias on one token, after the grammar's mask (vLLM's order, and epd's)."""

    def __init__(self, token_id: int, bias: float) -> None:
        self.token_id, self.bias = token_id, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.token_id] += self.bias
        return scores


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("structured_reasoning") / "qwen3_5", TinyVLMSpec(family="qwen3_5")
    )


@pytest.fixture(scope="module")
def reference(qwen3_5):
    """reference(bias on </think>, enable_thinking) -> the masked generate()'s new tokens; and the
    end marker's id."""
    model, processor = whole_model(qwen3_5)
    tokenizer = processor.tokenizer
    vocab_size = model.get_output_embeddings().weight.shape[0]
    eos = model.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos if isinstance(eos, list) else [eos]
    )
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    start_id, end_id = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])

    def tokens(bias: float, enable_thinking: bool = True) -> list[int]:
        text = processor.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
        )
        inputs = processor(text=[text], return_tensors="pt")
        prompt = inputs["input_ids"][0].tolist()
        # vLLM's is_reasoning_end of the prompt, spelled out: its last think marker is the end one
        markers = [t for t in prompt if t in (start_id, end_id)]
        ended = bool(markers) and markers[-1] == end_id
        assert ended is not enable_thinking, "the template did not open (or close) the block as expected"
        processors = [AfterReasoningMask(compiled, len(prompt), vocab_size, end_id, ended)]
        if bias:
            processors.append(Bias(end_id, bias))
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                logits_processor=LogitsProcessorList(processors),
            )
        return out[0, len(prompt) :].tolist()

    tokens.end_id = end_id  # type: ignore[attr-defined]
    tokens.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    return tokens


def _body(**fields) -> dict:
    return {"model": "epd", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "return_token_ids": True,
            "structured_outputs": {"regex": REGEX}, **fields}  # fmt: skip


def _chat(port: int, body: dict) -> dict:
    status, reply = post_json(port, "/v1/chat/completions", body)
    assert status == 200, reply
    return reply


def test_the_grammar_starts_after_the_models_end_of_reasoning_through_the_stack(qwen3_5, reference, tmp_path):
    end_id = reference.end_id
    # A bias that brings </think> after some reasoning (decode's side of the hand-off), found on
    # the reference (the tiny model is random: which one does is found, not assumed).
    later = next(
        (
            b
            for b in range(1, 20)
            if end_id in (ids := reference(b)) and 1 <= ids.index(end_id) <= MAX_TOKENS - 12
        ),
        None,
    )
    assert later is not None, "no bias on </think> brings it after a token of reasoning"
    cases = {
        "end first": ({"logit_bias": {str(end_id): 30}}, reference(30)),  # prefill's token is </think>
        "end later": ({"logit_bias": {str(end_id): later}}, reference(later)),
        "thinking off": ({"chat_template_kwargs": {"enable_thinking": False}}, reference(0, enable_thinking=False)),
    }  # fmt: skip
    assert cases["end first"][1][0] == end_id and 0 < cases["end later"][1].index(end_id)
    extra = {"gateway": ["--reasoning-parser", "qwen3"]}
    with Stack(qwen3_5, tmp_path / "logs", extra=extra, http=True) as stack:
        port = stack.http_port
        for name, (fields, want) in cases.items():
            choice = _chat(port, _body(**fields))["choices"][0]
            assert choice["token_ids"] == want, name
            end = want.index(end_id) if end_id in want else -1
            message = choice["message"]
            assert message["reasoning"] == (reference.decode(want[:end]) if end >= 0 else None), name
            content = reference.decode(want[end + 1 :])
            assert message["content"] == content, name
            if choice["finish_reason"] == "stop":
                assert re.fullmatch(REGEX, content), (name, content)

        # n choices: each its own grammar state (greedy: the reference twice).
        fields, want = cases["end later"]
        reply = _chat(port, _body(n=2, **fields))
        assert [c["token_ids"] for c in reply["choices"]] == [want, want]

        # A batch: the cases at once, with a request without a constraint among them.
        plain = _chat(
            port, {"model": "epd", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "return_token_ids": True}
        )["choices"][0]["token_ids"]
        bodies = [_body(**fields) for fields, _ in cases.values()] + [
            {"model": "epd", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "return_token_ids": True}
        ]
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda body: _chat(port, body), bodies))
        got = [r["choices"][0]["token_ids"] for r in replies]
        assert got == [want for _, want in cases.values()] + [plain]
