"""vLLM's sampling options (allowed_token_ids, bad_words, penalties, logit bias, min_tokens, min_p,
stop token ids) in the Sampler and the rules that end a generation, against values worked out by hand."""

from dataclasses import replace

import pytest
import torch

from epd.model_runtime.bad_words import tokenize_bad_words
from epd.model_runtime.detokenizer import IncrementalText, OutputText
from epd.model_runtime.logits_processors import LogitsProcessors
from epd.model_runtime.sampling import GenerationConfig, Sampler, SamplingFailed

EOS = 4


def _processed(config, logits, prompt=(), output=(), bad_words=()):
    processors = LogitsProcessors(config, prompt, {EOS}, bad_words)
    for token in output:
        processors.seen(token)
    return processors.before_sampling(torch.tensor(logits))


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    # token 0 in the prompt (positive logit), 1 in the output (negative), 2 in neither, 3 in both
    out = _processed(
        GenerationConfig(repetition_penalty=2.0), [4.0, -1.0, 3.0, 0.5, 1.0], prompt=[0, 3, 3], output=[1, 3]
    )
    assert out.tolist() == [2.0, -2.0, 3.0, 0.25, 1.0]
    # < 1 encourages: 4 / 0.5 = 8, -1 * 0.5 = -0.5
    out = _processed(
        GenerationConfig(repetition_penalty=0.5), [4.0, -1.0, 3.0, 0.0, 1.0], prompt=[0], output=[1]
    )
    assert out.tolist() == [8.0, -0.5, 3.0, 0.0, 1.0]


def test_presence_and_frequency_penalties_count_the_output_only():
    # output: token 1 twice, token 2 once; token 0 only in the prompt (not penalised)
    config = GenerationConfig(presence_penalty=0.5, frequency_penalty=0.25)
    out = _processed(config, [1.0, 1.0, 1.0, 1.0, 1.0], prompt=[0], output=[1, 2, 1])
    assert out.tolist() == [1.0, 1.0 - 0.5 - 2 * 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0]
    negative = _processed(GenerationConfig(presence_penalty=-2.0), [0.0] * 5, output=[3])
    assert negative.tolist() == [0.0, 0.0, 0.0, 2.0, 0.0]


def test_logit_bias_is_added_before_the_penalties():
    # token 2: 1 + 3 = 4, then repeated in the output: 4 / 2 = 2 (vLLM's order: bias first)
    config = GenerationConfig(logit_bias=((2, 3.0), (0, -100.0)), repetition_penalty=2.0)
    out = _processed(config, [1.0, 1.0, 1.0, 1.0, 1.0], output=[2])
    assert out.tolist() == [-99.0, 1.0, 2.0, 1.0, 1.0]


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_enough_tokens_are_out():
    config = GenerationConfig(min_tokens=2, stop_token_ids=(1,))
    processors = LogitsProcessors(config, (), {EOS})
    logits = torch.tensor([0.0, 5.0, 0.0, 0.0, 9.0])
    assert processors.before_sampling(logits).tolist() == [0.0, float("-inf"), 0.0, 0.0, float("-inf")]
    processors.seen(0)
    assert processors.before_sampling(logits)[[1, 4]].tolist() == [float("-inf")] * 2
    processors.seen(0)
    assert processors.before_sampling(logits).tolist() == logits.tolist()  # two out: free again
    assert logits.tolist() == [0.0, 5.0, 0.0, 0.0, 9.0]  # the caller's logits are not touched
    # ignore_eos still holds end-of-sequence back before min_tokens (vLLM's all_stop_token_ids
    # gains the model's end-of-sequence ids whatever ignore_eos says), and lets it through after
    ignoring = LogitsProcessors(
        GenerationConfig(min_tokens=2, ignore_eos=True, stop_token_ids=(1,)), (), {EOS, 3}
    )
    inf = float("inf")
    assert ignoring.before_sampling(logits).tolist() == [0.0, -inf, 0.0, -inf, -inf]
    ignoring.seen(0)
    ignoring.seen(0)
    assert ignoring.before_sampling(logits).tolist() == logits.tolist()


def test_greedy_sampler_with_min_tokens_counts_the_tokens_it_was_shown():
    """Decode's sampler is shown prefill's first token (`seen`) before it samples the second."""
    logits = torch.tensor([0.0, 1.0, 0.0, 0.0, 9.0])  # end-of-sequence first
    sampler = Sampler(GenerationConfig(min_tokens=3), stream=1, eos_token_ids={EOS})
    sampler.seen(1)
    assert [sampler(logits) for _ in range(3)] == [1, 1, EOS]


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    processors = LogitsProcessors(GenerationConfig(temperature=1.0, min_p=0.2), (), ())
    # threshold 0.2 x 0.5 = 0.1: 0.05 goes
    kept = processors.min_p(logits)
    assert torch.isinf(kept).tolist() == [False, False, False, True]
    # threshold 0.325: only 0.5 stays
    sampler = Sampler(GenerationConfig(temperature=1.0, min_p=0.65, seed=0))
    assert {sampler(logits) for _ in range(50)} == {0}
    free = Sampler(GenerationConfig(temperature=1.0, seed=0))
    assert len({free(logits) for _ in range(200)}) == 4  # without min_p every token comes up


def test_penalties_steer_greedy_decoding():
    """Greedy + a penalty chooses the argmax of the processed logits, and remembers its choices."""
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, 0.0])
    plain = Sampler(GenerationConfig())
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]
    # frequency 0.15: 3.0 -> 2.85 after one 0, so 1 (2.9) wins; then 0 (2.85 > 2.8 > 2.75), and
    # then 2 (2.8 > 2.75 > 2.7)
    penalised = Sampler(GenerationConfig(frequency_penalty=0.15))
    assert [penalised(logits) for _ in range(4)] == [0, 1, 0, 2]
    biased = Sampler(GenerationConfig(logit_bias=((3, 100.0),)))
    assert biased(logits) == 3


def test_the_default_config_builds_no_processors():
    """Only a request that asks for an option pays for it: min_p alone with greedy asks for nothing."""
    assert not GenerationConfig().processes_logits
    assert not GenerationConfig(min_p=0.5).processes_logits  # greedy ignores min_p
    assert GenerationConfig(min_p=0.5, temperature=1.0).processes_logits
    assert Sampler(GenerationConfig())._processors is None
    for field, value in [
        ("repetition_penalty", 1.1),
        ("presence_penalty", 0.1),
        ("frequency_penalty", -0.1),
        ("min_tokens", 1),
        ("logit_bias", ((1, 1.0),)),
        ("allowed_token_ids", (1,)),
        ("bad_words", ("red",)),
    ]:
        assert GenerationConfig(**{field: value}).processes_logits, field


@pytest.mark.parametrize(
    "config,vocab,message",
    [
        (
            GenerationConfig(repetition_penalty=0.0),
            None,
            r"repetition_penalty must be a finite number > 0 \(1 is off\)",
        ),
        (
            GenerationConfig(repetition_penalty=float("nan")),
            None,
            "repetition_penalty must be a finite number > 0",
        ),
        (GenerationConfig(presence_penalty=2.5), None, r"presence_penalty must be in \[-2, 2\]"),
        (GenerationConfig(frequency_penalty=float("nan")), None, r"frequency_penalty must be in \[-2, 2\]"),
        (GenerationConfig(min_p=1.5), None, r"min_p must be in \[0, 1\]"),
        # It named the SDK's field alone: an HTTP client that sent no max_tokens met a 32 it never set.
        (
            GenerationConfig(max_new_tokens=4, min_tokens=5),
            None,
            r"min_tokens must be between 0 and max_new_tokens "
            r"\(4: the OpenAI API's max_tokens or max_completion_tokens, the server's default when neither is sent\)",
        ),
        (GenerationConfig(min_tokens=-1), None, "min_tokens must be between 0"),
        (GenerationConfig(logit_bias=((1, 101.0),)), None, r"logit_bias of token 1 must be in \[-100, 100\]"),
        (GenerationConfig(logit_bias=((-1, 1.0),)), None, "logit_bias: token id -1 is outside"),
        (
            GenerationConfig(logit_bias=((7, 1.0),)),
            7,
            r"logit_bias: token id 7 is outside 0 to 6 \(this model's vocabulary\)",
        ),
        (GenerationConfig(logit_bias=((1, 1.0), (1, 2.0))), None, "logit_bias names a token id twice"),
        (
            GenerationConfig(logit_bias=tuple((i, 1.0) for i in range(1025))),
            None,
            "logit_bias has 1025 entries; at most 1024",
        ),
        (GenerationConfig(stop_token_ids=(9,)), 9, "stop_token_ids: token id 9 is outside 0 to 8"),
        (GenerationConfig(stop_token_ids=tuple(range(257))), None, "stop_token_ids has 257 ids; at most 256"),
        (GenerationConfig(allowed_token_ids=(3, 7)), 7, "allowed_token_ids: token id 7 is outside 0 to 6"),
        (GenerationConfig(allowed_token_ids=(-1,)), None, "allowed_token_ids: token id -1 is outside"),
        (
            GenerationConfig(allowed_token_ids=tuple(range(65537))),
            None,
            r"allowed_token_ids has 65537 ids; at most 65536 are accepted \(to keep a few tokens out",
        ),
        (GenerationConfig(bad_words=("red", "")), None, "bad_words cannot contain an empty string"),
        (GenerationConfig(bad_words=("  ",)), None, "or one of spaces alone"),
        (GenerationConfig(bad_words=("w",) * 129), None, "bad_words has 129 words; at most 128"),
        (GenerationConfig(bad_words=("w" * 513,)), None, "a bad word has 513 characters; at most 512"),
    ],
)
def test_validation_names_the_field_and_its_range(config, vocab, message):
    with pytest.raises(ValueError, match=message):
        config.validate(100, vocab)


def test_validation_accepts_the_bounds():
    GenerationConfig(
        repetition_penalty=1e-3,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        min_p=1.0,
        max_new_tokens=5,
        min_tokens=5,
        logit_bias=((0, -100.0), (6, 100.0)),
        stop_token_ids=(6,),
        allowed_token_ids=tuple(range(7)),
        bad_words=("w" * 512,) * 128,
    ).validate(100, 7)


INF = float("-inf")


def test_allowed_token_ids_leave_only_those_tokens_to_greedy_and_to_the_draw():
    logits = torch.tensor([9.0, 1.0, 3.0, 2.0, 8.0])
    config = GenerationConfig(allowed_token_ids=(3, 2, 3))  # repeats allowed, as vLLM's
    assert _processed(config, logits.tolist()).tolist() == [INF, INF, 3.0, 2.0, INF]
    assert Sampler(config)(logits) == 2  # the argmax over the allowed tokens, not 0
    sampled = Sampler(replace(config, temperature=1.0, seed=5))
    assert {sampled(logits) for _ in range(50)} == {2, 3}


def test_a_bad_word_of_one_token_is_banned_at_every_step_a_longer_one_after_its_other_tokens():
    words = ((1,), (2, 3), (0, 2, 3))  # token 1; "2 3"; "0 2 3"
    config = GenerationConfig(bad_words=("x",))
    logits = [1.0] * 5
    assert _processed(config, logits, bad_words=words).tolist() == [1.0, INF, 1.0, 1.0, 1.0]
    # after 2: token 3 would end "2 3"
    assert _processed(config, logits, output=[2], bad_words=words).tolist() == [1.0, INF, 1.0, INF, 1.0]
    # after 0 2: both words end with 3 (the longer one too)
    assert _processed(config, logits, output=[4, 0, 2], bad_words=words)[3] == INF
    # the word's other tokens must be the answer's last ones
    assert _processed(config, logits, output=[2, 4], bad_words=words)[3] == 1.0
    # only the answer counts: the prompt's last token 2 does not start "2 3" (vLLM's)
    assert _processed(config, logits, prompt=[2], bad_words=words)[3] == 1.0


def test_masks_come_before_the_logit_bias_which_cannot_lift_a_banned_token():
    """vLLM's order: allowed_token_ids, bad_words, then logit_bias and the penalties."""
    config = GenerationConfig(allowed_token_ids=(0, 1, 2), logit_bias=((3, 100.0), (2, 100.0), (1, 100.0)))
    out = _processed(config, [5.0, 1.0, 1.0, 1.0, 1.0], bad_words=((1,),))
    assert out.tolist() == [5.0, INF, 101.0, INF, INF]


def test_a_step_the_masks_leave_no_token_fails_with_what_to_change():
    config = GenerationConfig(allowed_token_ids=(1,), bad_words=("x",))
    for temperature in (0.0, 1.0):
        sampler = Sampler(replace(config, temperature=temperature, seed=0), bad_words_token_ids=((1,),))
        with pytest.raises(
            SamplingFailed, match="allowed_token_ids, bad_words leave no token .* allow more tokens"
        ):
            sampler(torch.zeros(5))


def test_bad_words_tokenise_with_and_without_a_leading_space_as_vllm():
    """The bare word always (leading spaces stripped); the spaced one only when it is a word token
    of its own: another first token, as many tokens (vLLM's `update_from_tokenizer`)."""
    vocab = {"red": [5], " red": [6], "big cat": [7, 8], " big cat": [9, 8], "xyz": [1, 2], " xyz": [3, 1, 2],
             "same": [4], " same": [4]}  # fmt: skip
    sequences = tokenize_bad_words(["red", "  big cat", "xyz", "same", "red"], lambda t: vocab[t], 10)
    assert sequences == ((5,), (6,), (7, 8), (9, 8), (1, 2), (4,))
    with pytest.raises(ValueError, match=r"bad_words: '\\u200b' gives no token with this model's tokenizer"):
        tokenize_bad_words(["\u200b"], lambda t: [], 10)
    with pytest.raises(ValueError, match=r"token ids \[12\] outside its logits \(0 to 9\)"):
        tokenize_bad_words(["big"], lambda t: [12], 10)


WORDS = {1: "Hello", 2: " wor", 3: "ld", 5: ".", 9: ""}


def _output(config, tokens):
    out = OutputText(lambda ids, **_: "".join(WORDS[i] for i in ids), {9}, config, eos_token_id=9)
    return [out.add(t) for t in tokens]


@pytest.mark.parametrize(
    "config,tokens,expected",
    [
        # a stop token ends the answer without its text; the text held back before it comes out
        (GenerationConfig(stop_token_ids=(5,)), (1, 5), [("Hello", ""), ("", "stop")]),
        (GenerationConfig(stop_token_ids=(5,), stop=("!!",)), (1, 5), [("Hell", ""), ("o", "stop")]),
        (
            GenerationConfig(stop_token_ids=(5,), include_stop_str_in_output=True),
            (1, 5),
            [("Hello", ""), (".", "stop")],
        ),
        # the matched stop string kept, nothing after it
        (
            GenerationConfig(stop=("o w",), include_stop_str_in_output=True),
            (1, 2),
            [("Hello", ""), (" w", "stop")],
        ),
        # before min_tokens, neither end-of-sequence nor a stop token nor a stop string ends it
        (GenerationConfig(min_tokens=3, stop_token_ids=(5,)), (5, 9, 5), [(".", ""), ("", ""), ("", "stop")]),
        (GenerationConfig(min_tokens=1, stop=("l",)), (1, 2, 3), [("Hello", ""), (" wor", ""), ("", "stop")]),
        # vLLM checks end-of-sequence and stop tokens before the length cap: either as the last
        # allowed token ends it "stop" (the stop token's text left out), as a stop string there does
        (GenerationConfig(max_new_tokens=2), (1, 9), [("Hello", ""), ("", "stop")]),
        (GenerationConfig(max_new_tokens=2, stop_token_ids=(5,)), (1, 5), [("Hello", ""), ("", "stop")]),
        (GenerationConfig(max_new_tokens=2), (1, 2), [("Hello", ""), (" wor", "length")]),
        (GenerationConfig(max_new_tokens=2, stop=(" w",)), (1, 2), [("Hell", ""), ("o", "stop")]),
        (GenerationConfig(max_new_tokens=3), (1, 9), [("Hello", ""), ("", "stop")]),
    ],
)
def test_output_text_with_stop_token_ids_include_stop_str_and_min_tokens(config, tokens, expected):
    assert _output(config, tokens) == expected


def test_a_stop_string_inside_the_min_tokens_text_never_matches():
    """vLLM looks for a stop string only where it ends in text added after min_tokens tokens."""
    text = IncrementalText(lambda ids: "".join(WORDS[i] for i in ids), stop=("Hello",), min_tokens=1)
    assert text.add(1) + text.add(2) == "Hello" and not text.stopped  # " wor" held back
