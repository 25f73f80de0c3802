"""xgrammar's constraints in the Sampler: the mask leaves exactly the allowed tokens, greedy picks
the best allowed one, the matcher goes on across the prefill -> decode hand-off, the answer ends
when the constraint is complete; bad specs and a server without xgrammar are clear 400s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from epd.model_runtime.detokenizer import OutputText
from epd.model_runtime.sampling import (
    GenerationConfig,
    InvalidConstraint,
    Sampler,
    SamplingFailed,
    StructuredOutputs,
)
from epd.model_runtime.structured_output import (
    GrammarCompiler,
    check_structured_outputs,
    choice_grammar,
    compiler_message,
)

SHIPPED = Path(__file__).resolve().parents[3] / "models" / "epd-tiny-videoqa"
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, {tokenizer.eos_token_id})


def test_greedy_picks_the_best_token_the_constraint_allows(tokenizer, compiler):
    spec = StructuredOutputs(choice=("red", "blue"))
    grammar = compiler.compile_now(spec)
    logits = torch.linspace(0, 1, VOCAB)  # the last ids score highest, and none of them is allowed
    sampler = Sampler(GenerationConfig(structured_outputs=spec), grammar=grammar)
    first = sampler(logits)
    allowed = (
        {tokenizer.encode(w)[0] for w in ("red", "blue")}
        | {t for t in range(VOCAB) if tokenizer.decode([t]) and "red".startswith(tokenizer.decode([t]))}
        | {t for t in range(VOCAB) if tokenizer.decode([t]) and "blue".startswith(tokenizer.decode([t]))}
    )
    assert first in allowed
    assert first == max(allowed)  # linspace: the largest allowed id has the largest logit
    assert logits.equal(torch.linspace(0, 1, VOCAB)), "the caller's logits (a batch row) are left as they are"


@pytest.mark.parametrize("byteorder", ["little", "big"])
@pytest.mark.parametrize("regex", ["[a-z ]*", "(red|blue) [0-9]+", "x"])
def test_the_mask_equals_xgrammars_own_kernel(compiler, regex, byteorder, monkeypatch):
    """The CPU mask unpacks the bitmask itself (7x faster on a large vocabulary): the same logits
    as xgrammar's apply_token_bitmask_inplace, step after step; elsewhere (CUDA, or a big-endian
    CPU, "big" here) xgrammar's kernel applies it on a copy."""
    monkeypatch.setattr("epd.model_runtime.structured_output.sys.byteorder", byteorder)
    spec = StructuredOutputs(regex=regex)
    state = compiler.compile_now(spec).matcher()
    reference = xgr.GrammarMatcher(compiler._xgrammar_compiler().compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    torch.manual_seed(1)
    for _ in range(4):
        logits = torch.randn(VOCAB)
        reference.fill_next_token_bitmask(bitmask)
        want = logits.clone().unsqueeze(0)
        xgr.apply_token_bitmask_inplace(want, bitmask, vocab_size=VOCAB)
        got = state.mask(logits)
        assert torch.equal(got, want[0]) and 0 < int((got > float("-inf")).sum()) < VOCAB
        token = int(torch.argmax(got))
        if token in reference.stop_token_ids:
            break
        state.accept(token)
        assert reference.accept_token(token)


def test_the_answer_ends_stop_when_the_constraint_is_complete_even_under_ignore_eos(tokenizer, compiler):
    spec = StructuredOutputs(regex="ab")
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, structured_outputs=spec)
    sampler = Sampler(config, grammar=compiler.compile_now(spec))
    output = OutputText(
        lambda ids, **options: tokenizer.decode(ids, **options), {tokenizer.eos_token_id}, config
    )
    logits = torch.zeros(VOCAB)
    finish = ""
    while not finish:
        _, finish = output.add(sampler(logits))
    assert (output.text.text, finish) == ("ab", "stop")  # ignore_eos alone would go on to 16 tokens
    assert sampler._grammar is not None and sampler._grammar.terminated


def test_decode_continues_the_matcher_from_prefills_first_token(tokenizer, compiler):
    """Decode's sampler is built afresh and told the first token (`seen`): its next mask is the
    one a single sampler would have after choosing that token."""
    spec = StructuredOutputs(regex="(red|blue) (circle|square)")
    grammar = compiler.compile_now(spec)
    config = GenerationConfig(structured_outputs=spec)
    torch.manual_seed(0)
    steps = [torch.randn(VOCAB) for _ in range(6)]
    alone = Sampler(config, grammar=grammar)
    want = [alone(logits) for logits in steps]
    prefill = Sampler(config, 0, grammar=grammar)
    first = prefill(steps[0])
    decode = Sampler(config, 1, grammar=grammar)
    decode.seen(first)
    assert [first, *(decode(logits) for logits in steps[1:])] == want
    with pytest.raises(InvalidConstraint, match="does not keep to the structured-output constraint"):
        Sampler(config, 1, grammar=grammar).seen(tokenizer.encode("zzz")[0])


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputs(regex="[a-"), "the structured-output regex does not compile: Regex parsing error"),
    (StructuredOutputs(json_schema='{"type": "objekt"}'), 'JSON schema does not compile: Unsupported type "objekt"'),
    (StructuredOutputs(grammar="root ::= "), "the structured-output grammar does not compile: EBNF parser error"),
    (StructuredOutputs(grammar='start ::= "a"'), "the structured-output grammar does not compile"),
])  # fmt: skip
def test_a_spec_that_does_not_compile_is_refused_with_the_compilers_reason(spec, message, compiler):
    with pytest.raises(InvalidConstraint, match=message) as caught:
        check_structured_outputs(spec)
    assert "/project/cpp" not in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(InvalidConstraint, match=message):
        compiler.compile_now(spec)


def test_compiler_messages_are_one_bounded_line_without_the_cpp_log_prefix():
    exc = RuntimeError("[03:51:58] /project/cpp/x.cc:5077: Check failed: (error.empty()) is false: Failed "
                       "to parse JSON: " + "y" * 1000 + "\nmore")  # fmt: skip
    message = compiler_message(exc)
    assert message.startswith("Failed to parse JSON: yyy") and len(message) == 300 and message.endswith("...")


def test_choices_with_quotes_backslashes_and_newlines_are_matched_literally(tokenizer):
    choices = ['say "hi"', "a\\b", "two\nlines", "é"]
    compiled = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    ).compile_grammar(choice_grammar(choices))
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    assert not xgr.GrammarMatcher(compiled).accept_string("say hi")


def test_a_server_without_xgrammar_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(
        InvalidConstraint, match=r"structured outputs need xgrammar.*pip install 'epd\[structured\]'"
    ):
        check_structured_outputs(StructuredOutputs(regex="a"))


def test_rows_without_a_constraint_build_no_matcher():
    assert Sampler(GenerationConfig())._grammar is None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holding_back_the_constraints_only_token_fails_the_request_saying_so(
    compiler, tokenizer, temperature
):
    """Once "a" is out, the constraint allows only end-of-sequence, which min_tokens holds back:
    no token is left, and the request fails with a message naming both (not a token outside it)."""
    spec = StructuredOutputs(regex="a")
    sampler = Sampler(
        GenerationConfig(min_tokens=4, temperature=temperature, seed=0, structured_outputs=spec),
        eos_token_ids={tokenizer.eos_token_id},
        grammar=compiler.compile_now(spec),
    )
    logits = torch.zeros(VOCAB)
    sampler(logits)  # "a" (or its token): the only start the constraint allows
    with pytest.raises(SamplingFailed, match="no token both keeps to the structured-output constraint"):
        sampler(logits)
