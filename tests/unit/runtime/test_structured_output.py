"""xgrammar's constraints in the Sampler: the mask leaves exactly the allowed tokens, greedy picks
the best allowed one, the matcher goes on across the prefill -> decode hand-off, the answer ends
when the constraint is complete; bad specs and a server without xgrammar are clear 400s. Under a
reasoning parser the constraint waits for the model's `</think>` (vLLM's rule, `reasoning_ended`),
across the hand-off too; a spec that compiles for too long is refused saying so."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from epd.model_runtime.detokenizer import OutputText
from epd.model_runtime.grammar_state import reasoning_ended
from epd.model_runtime.sampling import (
    ConstraintBusy,
    GenerationConfig,
    InvalidConstraint,
    Sampler,
    SamplingFailed,
    StructuredOutputs,
)
from epd.model_runtime.structured_output import (
    MAX_ABANDONED_COMPILES,
    GrammarCompiler,
    choice_grammar,
    compile_for,
    compiler_message,
)
from epd.transport.errors import code_of, retry_after_of

SHIPPED = Path(__file__).resolve().parents[3] / "models" / "epd-tiny-videoqa"
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, {tokenizer.eos_token_id})
    yield compiler
    compiler.close()


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
    monkeypatch.setattr("epd.model_runtime.grammar_state.sys.byteorder", byteorder)
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
        lambda ids, **options: tokenizer.decode(ids, **options),
        {tokenizer.eos_token_id},
        config,
        eos_token_id=tokenizer.eos_token_id,
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
        compiler.compile_now(spec)
    assert "/project/cpp" not in str(caught.value) and "\n" not in str(caught.value)


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
        asyncio.run(compile_for(object(), StructuredOutputs(regex="a")))


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


@pytest.fixture(scope="module")
def thinking_tokenizer():
    """The shipped tokenizer with a thinking model's markers as added tokens (as Qwen3's has them)."""
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.mark.parametrize(("ids", "ended"), [
    ([], False), ([7, 8], False), ([1, 7], False), ([2, 7], True), ([1, 7, 2], True),
    ([1, 2, 1, 7], False), ([2, 7, 1], False), ([1, 2, 7, 2], True),
])  # fmt: skip
def test_the_prompt_ends_the_reasoning_when_its_last_think_marker_is_the_end_one(ids, ended):
    """vLLM's `is_reasoning_end` (start 1, end 2): read from the prompt's end, a start marker
    first means thinking, an end marker first means it is over; neither, not over."""
    assert reasoning_ended(ids, 1, 2) is ended


def test_a_constraint_after_the_reasoning_masks_nothing_until_the_end_token(thinking_tokenizer):
    """Before `</think>` the sampler chooses as without a constraint (the matcher never sees those
    tokens, nor `</think>`); after it, exactly as a constraint from the first token would; a
    decoder told the first token (`seen`) continues alike, on either side of the end."""
    vocab = len(thinking_tokenizer)
    end = thinking_tokenizer.convert_tokens_to_ids("</think>")
    compiler = GrammarCompiler(thinking_tokenizer, vocab, {thinking_tokenizer.eos_token_id})
    regex = "(red|blue) (circle|square)"
    gated = compiler.compile_now(StructuredOutputs(regex=regex, after_reasoning=True))
    plain = compiler.compile_now(StructuredOutputs(regex=regex))
    torch.manual_seed(0)
    thinking = [torch.randn(vocab) for _ in range(3)]
    forced_end = torch.zeros(vocab)
    forced_end[end] = 10.0
    answer = [torch.randn(vocab) for _ in range(6)]
    config = GenerationConfig(structured_outputs=StructuredOutputs(regex=regex, after_reasoning=True))

    unconstrained = [int(torch.argmax(logits)) for logits in thinking]
    after = Sampler(config, grammar=plain)
    want = [*unconstrained, end, *(after(logits) for logits in answer)]
    assert any(not plain.matcher().mask(logits).equal(logits) for logits in thinking), "the mask would bite"

    alone = Sampler(config, grammar=gated)
    steps = [*thinking, forced_end, *answer]
    assert [alone(logits) for logits in steps] == want
    for split in (1, len(thinking) + 1):  # decode takes over inside the reasoning, or right after its end
        prefill = Sampler(config, grammar=gated)
        got = [prefill(logits) for logits in steps[:split]]
        decode = Sampler(config, 1, grammar=gated)
        for token in got:
            decode.seen(token)
        assert [*got, *(decode(logits) for logits in steps[split:])] == want, split


def test_a_prompt_that_closed_the_thinking_block_is_constrained_from_the_first_token(thinking_tokenizer):
    vocab = len(thinking_tokenizer)
    start, end = thinking_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    compiler = GrammarCompiler(thinking_tokenizer, vocab, {thinking_tokenizer.eos_token_id})
    spec = StructuredOutputs(regex="(red|blue) x", after_reasoning=True)
    gated = compiler.compile_now(spec)
    assert gated.prompt_ends_reasoning([5, start, 9, end, 9]) and not gated.prompt_ends_reasoning(
        [5, start, 9]
    )
    assert not compiler.compile_now(StructuredOutputs(regex="(red|blue) x")).prompt_ends_reasoning(
        [start, end]
    )
    torch.manual_seed(2)
    steps = [torch.randn(vocab) for _ in range(4)]
    from_start = Sampler(
        GenerationConfig(), grammar=compiler.compile_now(StructuredOutputs(regex="(red|blue) x"))
    )
    want = [from_start(logits) for logits in steps]
    got = Sampler(GenerationConfig(), grammar=gated, prompt_ends_reasoning=True)
    assert [got(logits) for logits in steps] == want
    decode = Sampler(GenerationConfig(), 1, grammar=gated, prompt_ends_reasoning=True)
    decode.seen(want[0])
    assert [decode(logits) for logits in steps[1:]] == want[1:]


def test_a_constraint_after_the_reasoning_needs_the_think_markers(compiler):
    with pytest.raises(InvalidConstraint, match="does not have <think> and </think> as single tokens"):
        compiler.compile_now(StructuredOutputs(regex="a", after_reasoning=True))


SLOW_REGEX = "[a-z]*" * 3000
"""Compiles for about 1.4 s on the shipped vocabulary (2-core VM): xgrammar's states multiply."""


def held_compiles(compiler: GrammarCompiler) -> tuple[threading.Event, threading.Event]:
    """(started, release): `compiler`'s compiles, real ones, start only once `release` is set, and
    say so in `started`: a test that needs a compile still running past its deadline holds it
    there, whatever the machine's speed (a slow regex's compile took 4 s under load, under 0.7 s
    on a quiet machine)."""
    started, release = threading.Event(), threading.Event()
    compile_now = compiler.compile_now

    def held(spec: StructuredOutputs):
        started.set()
        release.wait()
        return compile_now(spec)

    compiler.compile_now = held  # type: ignore[method-assign]
    return started, release


CLOSE_WAIT_S = 120.0
"""How long a test's compiler, closing, waits for the compiles it left running past their deadline."""


@pytest.fixture
def new_compiler():
    """`new_compiler(tokenizer[, vocab])`: a GrammarCompiler closed at the test's end, waiting for
    the compiles left running past their deadline (xgrammar's cannot be stopped: each kept its
    thread and a core busy into the next tests)."""
    made: list[GrammarCompiler] = []

    def new(tokenizer, vocab: int = VOCAB) -> GrammarCompiler:
        made.append(GrammarCompiler(tokenizer, vocab, {tokenizer.eos_token_id}))
        return made[-1]

    yield new
    for compiler in made:
        compiler.close(wait_s=CLOSE_WAIT_S)


def test_a_spec_that_compiles_for_too_long_is_refused_and_others_go_on(tokenizer, new_compiler):
    """The deadline refuses it with what to do; the compile it cannot stop runs on elsewhere, so
    the next spec compiles on a fresh thread at once; the slow spec asked again is refused without
    another compile."""
    compiler = new_compiler(tokenizer)
    compiler.prepare()

    async def run() -> None:
        with pytest.raises(
            InvalidConstraint, match=r"regex took longer than 0.05 s to compile .*simplify it"
        ):
            await compiler.compile(StructuredOutputs(regex=SLOW_REGEX), timeout_s=0.05)
        assert compiler.num_abandoned == 1
        # a second request queued behind nothing: the slow compile's thread was left to it
        await compiler.compile(StructuredOutputs(regex="(red|blue) x"), timeout_s=30)
        with pytest.raises(InvalidConstraint, match="took longer than 0.05 s"):
            await compiler.compile(StructuredOutputs(regex=SLOW_REGEX), timeout_s=0.05)
        assert compiler.num_abandoned == 1  # refused at once: no second compile left running

    asyncio.run(run())


def test_compiles_queued_behind_one_that_ran_past_its_deadline_are_compiled(tokenizer, new_compiler):
    compiler = new_compiler(tokenizer)
    compiler.prepare()

    async def run() -> list[object]:
        slow = compiler.compile(StructuredOutputs(regex=SLOW_REGEX + "x"), timeout_s=0.05)
        queued = [compiler.compile(StructuredOutputs(regex=f"a{i}"), timeout_s=30) for i in range(3)]
        return await asyncio.gather(slow, *queued, return_exceptions=True)

    slow, *queued = asyncio.run(run())
    assert isinstance(slow, InvalidConstraint) and "took longer" in str(slow)
    assert all(not isinstance(q, BaseException) for q in queued), queued


def test_a_slow_spec_is_remembered_whether_or_not_it_waits_for_the_reasoning(
    thinking_tokenizer, new_compiler
):
    """The same grammar compiles as slowly under a reasoning parser (a chat request's) as from the
    first token (the SDK's): asked both ways, one compile is left running, not two."""
    compiler = new_compiler(thinking_tokenizer, len(thinking_tokenizer))
    compiler.prepare()

    async def run() -> None:
        for after_reasoning in (False, True):
            with pytest.raises(InvalidConstraint, match="took longer than 0.05 s"):
                spec = StructuredOutputs(regex=SLOW_REGEX + "y", after_reasoning=after_reasoning)
                await compiler.compile(spec, timeout_s=0.05)
        assert compiler.num_abandoned == 1

    asyncio.run(run())


def test_a_compile_whose_request_went_away_still_has_its_deadline(tokenizer, new_compiler):
    """A client that goes away while its spec compiles (a cancelled await) left the compile on the
    compiler's one thread with no deadline: every later spec waited behind it, however long it ran
    (a pathological spec sent and dropped, again and again, held them all). Its deadline still
    leaves the thread to it, and the spec is remembered as too slow."""
    compiler = new_compiler(tokenizer)
    compiler.prepare()
    # Asked again below while its abandoned compile still runs (held there): one that has finished
    # by then is served from the cache instead, as it should be.
    slow = StructuredOutputs(regex="(red|green) z")
    started, release = held_compiles(compiler)

    async def run() -> None:
        task = asyncio.ensure_future(compiler.compile(slow, timeout_s=0.5))
        await asyncio.to_thread(started.wait)  # compiling
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.6)  # past its deadline (0.5 s from its start)
        assert compiler.num_abandoned == 1
        assert compiler.num_abandoned_running == 1  # still compiling: its refusal still holds
        with pytest.raises(InvalidConstraint, match="took longer than 0.5 s"):
            await compiler.compile(slow, timeout_s=0.5)
        release.set()
        await compiler.compile(StructuredOutputs(regex="(red|blue) z"), timeout_s=30)

    try:
        asyncio.run(run())
    finally:
        release.set()


def test_compiles_left_running_are_bounded_and_past_that_new_specs_are_refused_to_retry(
    tokenizer, new_compiler
):
    """Each compile that runs past its deadline keeps a thread (and a core) to its end: past
    MAX_ABANDONED_COMPILES of them still running, a spec that needs compiling is refused at once
    (RESOURCE_EXHAUSTED to retry later, `retry_after_s`), and no thread is started for it; a spec
    compiled before (in xgrammar's cache) is still served."""
    compiler = new_compiler(tokenizer)
    compiler.prepare()
    known = StructuredOutputs(regex="(red|blue) k")

    async def run() -> None:
        await compiler.compile(known, timeout_s=30)
        for i in range(MAX_ABANDONED_COMPILES):
            with pytest.raises(InvalidConstraint, match="took longer than 0.05 s"):
                await compiler.compile(StructuredOutputs(regex=SLOW_REGEX + f"b{i}"), timeout_s=0.05)
        assert compiler.num_abandoned_running == MAX_ABANDONED_COMPILES
        for spec in (StructuredOutputs(regex=SLOW_REGEX + "b"), StructuredOutputs(regex="a new one")):
            with pytest.raises(
                ConstraintBusy, match="too many slow structured-output specs .*retry later"
            ) as busy:
                await compiler.compile(spec, timeout_s=0.05)
            assert busy.value.retry_after_s > 0
            assert code_of(busy.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert retry_after_of(busy.value) == busy.value.retry_after_s  # sent as the stage's retry mark
        assert compiler.num_abandoned == MAX_ABANDONED_COMPILES  # none started
        await compiler.compile(known, timeout_s=30)

    asyncio.run(run())


def test_a_slow_spec_whose_compile_finished_is_served_from_the_cache(tokenizer, new_compiler):
    """The spec refused as too slow is remembered only while its compile runs: once that compile
    has finished (xgrammar cached it), asking again under the same deadline is served."""
    compiler = new_compiler(tokenizer)
    compiler.prepare()
    slow = StructuredOutputs(regex="(red|green) c")
    _, release = held_compiles(compiler)  # held past its deadline, whatever the machine

    async def run() -> None:
        with pytest.raises(InvalidConstraint, match="took longer than 0.5 s"):
            await compiler.compile(slow, timeout_s=0.5)
        assert compiler.num_abandoned_running == 1
        release.set()
        while compiler.num_abandoned_running:
            await asyncio.sleep(0.05)
        grammar = await compiler.compile(slow, timeout_s=0.5)
        assert grammar.matcher() is not None
        assert compiler.num_abandoned == 1

    try:
        asyncio.run(run())
    finally:
        release.set()
