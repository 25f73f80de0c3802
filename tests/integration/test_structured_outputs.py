"""Structured outputs through the real stack (three service processes and the gateway) and the
embedded pipeline: with a constraint, every token is the argmax of the unsplit model's logits
masked by the constraint's bitmask, the reference being `generate()` with a LogitsProcessor built
from xgrammar's own matcher (no epd code in it); the answer parses (JSON, schema, regex, choice)
and ends "stop" when complete; requests without one in the same batch keep their plain greedy
tokens; a spec that does not compile is a 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json
import math
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
import xgrammar as xgr
from transformers import LogitsProcessorList

from epd.client import EpdClient
from epd.client.types import EpdError
from epd.gateway.ask_types import AskRequest
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message, reference_inputs, whole_model
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions
from tests.embedded import request_summary
from tests.integration.structured_cases import (
    CASES,
    CHOICES,
    MAX_TOKENS,
    NUM_FRAMES,
    QUESTION,
    REGEX,
    SCHEMA,
    GrammarMask,
    chat,
    chat_request,
    check_text,
    masked_references,
)
from tests.reference import decode_for_test


@pytest.fixture(scope="module")
def video(media_files):
    return decode_for_test(media_files["mp4"], NUM_FRAMES)


@pytest.fixture(scope="module")
def references(tiny_models, video):
    """Each case's reference tokens on the tiny Qwen2-VL, and the plain greedy ones ("plain")."""
    return masked_references(tiny_models["qwen2_vl"], video, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_constrained_greedy_tokens_equal_the_masked_reference_through_the_stack(
    shared_stack, media_files, references, name
):
    status, body = chat(shared_stack.http_port, media_files, **CASES[name][0])
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == references[name]
    if name in ("json_schema", "regex", "choice"):  # complete within MAX_TOKENS on this model
        assert choice["finish_reason"] == "stop"
    if choice["finish_reason"] == "stop":
        check_text(name, choice["message"]["content"])


def test_a_batch_where_only_some_requests_have_a_constraint(shared_stack, media_files, references):
    """Sent at once, they decode in one batch: each row keeps its own tokens."""
    names = ["plain", "regex", "plain", "json_schema", "choice", "plain"]
    with ThreadPoolExecutor(len(names)) as pool:
        replies = list(
            pool.map(
                lambda n: chat(shared_stack.http_port, media_files, **({} if n == "plain" else CASES[n][0])),
                names,
            )
        )
    for name, (status, body) in zip(names, replies, strict=True):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == references[name], name


def test_max_tokens_still_caps_a_constrained_answer(shared_stack, media_files, references):
    status, body = chat(shared_stack.http_port, media_files, max_tokens=3, **CASES["json_schema"][0])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == references["json_schema"][:3]
    assert body["choices"][0]["finish_reason"] == "length"


def test_the_sdk_asks_for_structured_outputs_over_grpc(shared_stack, media_files, references):
    with EpdClient(shared_stack.gateway, timeout_s=120) as client:
        result = client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS,
                            structured_outputs={"regex": REGEX})  # fmt: skip
        assert result.token_ids == references["regex"] and re.fullmatch(REGEX, result.answer)
        result = client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=MAX_TOKENS,
                            response_format={"type": "json_object"})  # fmt: skip
        assert result.token_ids == references["json_object"]
        with pytest.raises(EpdError) as caught:
            client.ask(
                media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, structured_outputs={"regex": "(a"}
            )
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "the structured-output regex does not compile" in caught.value.message


@pytest.mark.parametrize(("fields", "message"), [
    ({"guided_regex": "[a-"}, "the structured-output regex does not compile: Regex parsing error"),
    ({"guided_json": {"type": "objekt"}}, 'JSON schema does not compile: Unsupported type \\"objekt\\"'),
    ({"guided_grammar": "root ::= "}, "the structured-output grammar does not compile: EBNF parser error"),
])  # fmt: skip
def test_a_spec_that_does_not_compile_is_a_400_with_the_compilers_reason(
    shared_stack, media_files, fields, message
):
    status, body = chat(shared_stack.http_port, media_files, **fields)
    assert status == 400, body
    assert message.replace('\\"', '"') in body["error"]["message"]


def test_embedded_mixed_batch_equals_the_references(tiny_models, media_files, references):
    specs = {
        "plain": None,
        "json_schema": StructuredOutputs(json_schema=json.dumps(SCHEMA), disable_any_whitespace=True),
        "regex": StructuredOutputs(regex=REGEX),
        "choice": StructuredOutputs(choice=tuple(CHOICES)),
    }

    async def run(pipeline):
        requests = [
            AskRequest(
                question_messages(QUESTION),
                MediaInput(media_files["mp4"].read_bytes()),
                SamplingOptions(num_frames=NUM_FRAMES),
                GenerationConfig(max_new_tokens=MAX_TOKENS, structured_outputs=spec),
            )
            for spec in specs.values()
        ]
        return await asyncio.gather(*(request_summary(pipeline, r) for r in requests))

    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        summaries = asyncio.run(run(pipeline))
    for name, summary in zip(specs, summaries, strict=True):
        assert summary.token_ids == references[name], name
        if name != "plain":
            check_text(name, summary.answer)


def test_sampled_and_streamed_answers_keep_to_the_constraint(shared_stack, media_files):
    """Sampling draws only among the allowed tokens (the same seed, the same answer); a streamed
    answer's chunks add up to text that keeps to it."""
    fields = {"guided_regex": REGEX, "temperature": 1.0, "seed": 3}
    replies = [chat(shared_stack.http_port, media_files, **fields) for _ in range(2)]
    for status, body in replies:
        assert status == 200, body
        assert re.fullmatch(REGEX, body["choices"][0]["message"]["content"])
    assert replies[0][1]["choices"][0]["token_ids"] == replies[1][1]["choices"][0]["token_ids"]
    request = chat_request(
        shared_stack.http_port, media_files, stream=True, structured_outputs={"choice": CHOICES}
    )
    text, finish = "", None
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    assert text in CHOICES and finish == "stop"


def test_embedded_on_qwen2_5_vl_equals_its_masked_reference(tiny_models, media_files, video):
    """Another family's vocabulary and adapter: the same masked argmax, token for token."""
    model_dir = tiny_models["qwen2_5_vl"]
    want = masked_references(model_dir, video, ["regex", "json_schema"])
    specs = {
        "regex": StructuredOutputs(regex=REGEX),
        "json_schema": StructuredOutputs(json_schema=json.dumps(SCHEMA), disable_any_whitespace=True),
    }
    with build_embedded_pipeline(ModelConfig(model=str(model_dir))) as pipeline:
        for name, spec in specs.items():
            request = AskRequest(
                question_messages(QUESTION),
                MediaInput(media_files["mp4"].read_bytes()),
                SamplingOptions(num_frames=NUM_FRAMES),
                GenerationConfig(max_new_tokens=MAX_TOKENS, structured_outputs=spec),
            )
            summary = asyncio.run(request_summary(pipeline, request))
            assert summary.token_ids == want[name], name
            if summary.finish_reason == "stop":
                check_text(name, summary.answer)


def test_logprobs_under_a_constraint_are_of_the_masked_distribution(tiny_models, media_files, video):
    """As vLLM's (its grammar bitmask is applied before its sampler computes logprobs): each
    token's logprob and top-k are log_softmax of the logits the constraint leaves, which
    generate() reports as its processed scores under the xgrammar LogitsProcessor; tokens the
    constraint refuses never appear among the top ones with a finite value."""
    k = 5
    model_dir = tiny_models["qwen2_vl"]
    model, processor = whole_model(model_dir)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    eos = model.generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(
        processor.tokenizer, vocab_size=vocab_size, stop_token_ids=eos if isinstance(eos, list) else [eos]
    )
    inputs = reference_inputs(processor, video, question_message(video, QUESTION))
    mask = GrammarMask(
        xgr.GrammarCompiler(info).compile_regex(REGEX), inputs["input_ids"].shape[1], vocab_size
    )
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, output_scores=True,
                             return_dict_in_generate=True, logits_processor=LogitsProcessorList([mask]))  # fmt: skip
    want = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    reference = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)  # [tokens, vocab]
    with build_embedded_pipeline(ModelConfig(model=str(model_dir))) as pipeline:
        request = AskRequest(
            question_messages(QUESTION),
            MediaInput(media_files["mp4"].read_bytes()),
            SamplingOptions(num_frames=NUM_FRAMES),
            GenerationConfig(
                max_new_tokens=MAX_TOKENS, logprobs=k, structured_outputs=StructuredOutputs(regex=REGEX)
            ),
        )
        summary = asyncio.run(request_summary(pipeline, request))
    assert summary.token_ids == want and summary.logprobs is not None
    for i, lp in enumerate(summary.logprobs):
        assert math.isclose(lp.logprob, float(reference[i, want[i]]), rel_tol=1e-5, abs_tol=1e-5), i
        finite = [(t.token_id, t.logprob) for t in lp.top if t.logprob > float("-inf")]
        values, ids = torch.topk(reference[i], k)
        want_top = [(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v > float("-inf")]
        assert [t for t, _ in finite] == [t for t, _ in want_top], i
        assert all(
            math.isclose(v, w, rel_tol=1e-5, abs_tol=1e-5) for (_, v), (_, w) in zip(finite, want_top)
        ), i
    assert any(len([t for t in lp.top if t.logprob > float("-inf")]) < k for lp in summary.logprobs), (
        "the constraint left k tokens or more at every step; the masked top-k would prove little"
    )
