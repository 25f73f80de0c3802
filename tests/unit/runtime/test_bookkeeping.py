"""Bookkeeping tested alone: KV store, detokeniser, sampler, configs."""

import pytest
import torch

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.detokenizer import IncrementalText, OutputText
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import GenerationConfig, Sampler
from epd.prefill_svc.kv_store import KvStore
from epd.stages.errors import NotFound, ResourceExhausted


def _cache(num_tokens=3):
    k = torch.zeros(1, 2, num_tokens, 4)
    return KvCache([k, k.clone()], [k.clone(), k.clone()])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_kv_store_hands_over_once():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache())
    assert store.num_bytes == _cache().num_bytes == 4 * 24 * 4
    assert store.take(handle).num_cached_tokens == 3
    assert store.num_bytes == 0
    with pytest.raises(NotFound, match="unknown or expired"):
        store.take(handle)


def test_kv_store_budget_and_ttl():
    clock = FakeClock()
    store = KvStore(max_bytes=_cache().num_bytes * 2, ttl_s=5, clock=clock)
    store.put(_cache())
    h2 = store.put(_cache())
    with pytest.raises(ResourceExhausted, match="waiting for decoders"):
        store.put(_cache())
    clock.now = 6.0  # both expire
    h3 = store.put(_cache())
    assert store.num_expired == 2 and len(store) == 1
    with pytest.raises(NotFound):
        store.take(h2)
    store.take(h3)


def test_kv_cache_wire_names_round_trip():
    c = _cache()
    named = dict(c.named_tensors())
    assert list(named) == ["layer.0.key", "layer.0.value", "layer.1.key", "layer.1.value"]
    back = KvCache.from_named_tensors(named)
    assert back.num_layers == 2 and back.num_bytes == c.num_bytes
    del named["layer.1.value"]
    with pytest.raises(ValueError, match="missing tensor"):
        KvCache.from_named_tensors(named)


def test_incremental_text_holds_back_stop_prefix():
    words = {1: "Hello", 2: " wor", 3: "ld", 4: " END", 5: "!"}
    text = IncrementalText(lambda ids: "".join(words[i] for i in ids), stop=(" END",))
    released = [text.add(i) for i in (1, 2, 3, 4)]
    assert "".join(released) == "Hello world"
    assert text.stopped


@pytest.mark.parametrize("stop", [("llow", "e"), ("e", "llow")])
def test_incremental_text_cuts_at_the_earliest_stop_string_whatever_their_order(stop):
    """One token completes two stop strings: the answer holds neither (it was cut at the first
    string of the list: "ye" with ("llow", "e"))."""
    words = {1: "y", 2: "ellow"}
    text = IncrementalText(lambda ids: "".join(words[i] for i in ids), stop=stop)
    assert text.add(1) == ""  # "y" could start neither, but one character is held back ("llow")
    assert text.add(2) == "y"
    assert text.stopped and text.text == "y"


def test_incremental_text_waits_for_whole_characters():
    pieces = {1: "a", 2: "\ufffd", 3: "é"}

    def decode(ids):
        s = "".join(pieces[i] for i in ids)
        return s.replace("\ufffdé", "é")  # token 2 is half a character until token 3 arrives

    text = IncrementalText(decode)
    assert text.add(1) == "a"
    assert text.add(2) == ""
    assert text.add(3) == "é"
    assert text.flush() == ""


@pytest.mark.parametrize(
    "config,tokens,expected",
    [
        (GenerationConfig(max_new_tokens=3), (1, 2, 3), [("Hello", ""), (" wor", ""), ("ld", "length")]),
        (GenerationConfig(max_new_tokens=1), (1,), [("Hello", "length")]),
        (GenerationConfig(), (1, 9), [("Hello", ""), ("", "stop")]),  # 9: end of sequence
        (GenerationConfig(ignore_eos=True), (9,), [("", "")]),
        (GenerationConfig(stop=("lo",)), (1,), [("Hel", "stop")]),
        (GenerationConfig(stop=("!!",)), (1, 2), [("Hell", ""), ("o wo", "")]),  # one char held back
    ],
)
def test_output_text_applies_the_rules_that_end_a_generation(config, tokens, expected):
    """Decode's steps and prefill's first token go through these rules (`OutputText`): a finish
    releases what was held back."""
    words = {1: "Hello", 2: " wor", 3: "ld", 9: ""}
    out = OutputText(lambda ids, **_: "".join(words[i] for i in ids), {9}, config, eos_token_id=9)
    assert [out.add(t) for t in tokens] == expected


def test_sampler_greedy_and_seeded():
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9])
    assert Sampler(GenerationConfig())(logits) == 1
    assert Sampler(GenerationConfig(temperature=1.0, top_k=1))(logits) == 1
    a = [
        Sampler(GenerationConfig(temperature=1.0, seed=7))(
            torch.randn(50, generator=torch.Generator().manual_seed(i))
        )
        for i in range(20)
    ]
    b = [
        Sampler(GenerationConfig(temperature=1.0, seed=7))(
            torch.randn(50, generator=torch.Generator().manual_seed(i))
        )
        for i in range(20)
    ]
    assert a == b
    top_p = Sampler(GenerationConfig(temperature=1.0, top_p=0.01, seed=3))
    assert all(top_p(logits) == 1 for _ in range(10))


def test_configs_validate():
    with pytest.raises(ValueError, match="dtype must be one of"):
        ModelConfig(dtype="float8")
    with pytest.raises(
        ValueError, match="max_new_tokens must be between 1 and 10 .the OpenAI API's max_tokens"
    ):
        GenerationConfig(max_new_tokens=11).validate(10)
    GenerationConfig(stop=("s" * 512,) * 32).validate(100)  # at the bounds
    with pytest.raises(ValueError, match="stop has 33 strings"):
        GenerationConfig(stop=("s",) * 33).validate(100)
    with pytest.raises(ValueError, match="a stop string has 513 characters"):
        GenerationConfig(stop=("s" * 513,)).validate(100)
    with pytest.raises(ValueError, match="top_p"):
        GenerationConfig(top_p=0).validate(100)


@pytest.mark.parametrize("temperature", [1e-45, 5e-38, 1e-6])
def test_a_tiny_temperature_is_greedy_and_never_nan(temperature):
    """Dividing by 1e-45 sent the logits to inf and torch.multinomial to an error that failed
    every request of the batch; below 1e-5 (vLLM's bound) it is greedy."""
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9])
    assert Sampler(GenerationConfig(temperature=temperature, seed=1))(logits) == 1


def test_a_small_temperature_samples_without_overflow():
    logits = torch.tensor([-3e38, 3e38, 0.0])  # (logits / 1e-5) alone would overflow to inf - inf
    assert Sampler(GenerationConfig(temperature=1e-5, seed=1))(logits) == 1


def test_seeds_that_share_their_low_32_bits_or_neighbour_draw_different_streams():
    """torch's CPU generator keeps 32 bits of its seed: seed 7 and 2**32 + 7 drew the same tokens,
    and seed s's decode stream (seed + 1) was seed s + 1's prefill stream."""
    logits = torch.zeros(1000)

    def draws(seed, stream=0):
        sampler = Sampler(GenerationConfig(temperature=1.0, seed=seed), stream=stream)
        return [sampler(logits) for _ in range(8)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(7 + 2**32)
    assert draws(-1) != draws(2**32 - 1)
    assert draws(5, stream=1) != draws(6, stream=0)
    assert draws(5, stream=1) != draws(5, stream=0)


def test_no_seed_draws_a_fresh_one_per_request_once():
    config = GenerationConfig(temperature=1.0)
    drawn = {config.with_drawn_seed().seed for _ in range(4)}
    assert None not in drawn and len(drawn) == 4
    once = config.with_drawn_seed()
    assert once.with_drawn_seed() == once  # a seed, once drawn, stays
    assert GenerationConfig(temperature=0.0).with_drawn_seed().seed is None  # greedy needs none
    assert GenerationConfig(temperature=1.0, seed=0).with_drawn_seed().seed == 0
    logits = torch.zeros(1000)
    unseeded = [tuple(Sampler(config)(logits) for _ in range(8)) for _ in range(3)]
    assert len(set(unseeded)) == 3  # a stage called without a seed samples afresh


@pytest.mark.parametrize(
    ("config", "tokens", "stop_reason"),
    [
        (GenerationConfig(stop=("lo",)), (1,), "lo"),  # the stop string that matched
        (GenerationConfig(stop=("zz", "wor", "o w")), (1, 2), "o w"),  # the earliest of two matches
        (GenerationConfig(stop_token_ids=(2,)), (1, 2), 2),  # the stop token's id
        (GenerationConfig(stop_token_ids=(2,), include_stop_str_in_output=True), (1, 2), 2),
        # End of sequence, also asked for as a stop token: vLLM's check_stop tests the EOS first
        (GenerationConfig(stop_token_ids=(9,)), (1, 9), None),
        (GenerationConfig(stop_token_ids=(9,), ignore_eos=True), (1, 9), 9),  # then it is a stop token alone
        (GenerationConfig(), (1, 9), None),  # end of sequence
        (GenerationConfig(max_new_tokens=2, stop_token_ids=(2,)), (1, 2), 2),  # before the length limit
        (GenerationConfig(max_new_tokens=1, stop=("ell",)), (1,), "ell"),  # a stop string at the limit
        (GenerationConfig(stop=("lo",)), (3,), None),  # still going on
    ],
)
def test_output_text_names_the_stop_that_ended_the_answer(config, tokens, stop_reason):
    """vLLM's `stop_reason`: the matched stop string, the stop token id, else None (EOS, length)."""
    words = {1: "Hello", 2: " wor", 3: "ld", 9: ""}
    out = OutputText(lambda ids, **_: "".join(words[i] for i in ids), {9}, config, eos_token_id=9)
    for token in tokens:
        out.add(token)
    assert out.stop_reason == stop_reason
    assert type(out.stop_reason) is type(stop_reason)


@pytest.mark.parametrize(
    ("config", "tokens", "finish", "stop_reason"),
    [
        (GenerationConfig(), (1, 9), "stop", None),  # the tokenizer's end of sequence
        (GenerationConfig(), (1, 8), "stop", 8),  # the generation config's other one: a stop token
        (GenerationConfig(stop_token_ids=(8,)), (1, 8), "stop", 8),  # listed too: the same
        (GenerationConfig(ignore_eos=True), (1, 8), "", None),  # ignore_eos lets both through
        (GenerationConfig(min_tokens=3), (1, 8), "", None),  # held back before min_tokens, as a stop token
    ],
)
def test_the_models_other_end_of_sequence_ids_end_an_answer_as_stop_tokens(
    config, tokens, finish, stop_reason
):
    """vLLM adds the generation config's eos ids other than the tokenizer's to the request's
    stop_token_ids: an answer GLM-4.1V ends with <|user|> has that id for its stop_reason, where
    one the tokenizer's end of sequence ends has none (check_stop tests it first)."""
    words = {1: "Hello", 8: "", 9: ""}
    out = OutputText(lambda ids, **_: "".join(words[i] for i in ids), {8, 9}, config, eos_token_id=9)
    assert [out.add(t)[1] for t in tokens][-1] == finish
    assert (out.stop_reason, type(out.stop_reason)) == (stop_reason, type(stop_reason))


@pytest.mark.parametrize(
    ("config", "tokens", "answer"),
    [
        (GenerationConfig(skip_special_tokens=False), (1, 9), "Hello"),  # the EOS that ended it
        (GenerationConfig(skip_special_tokens=False, include_stop_str_in_output=True), (1, 9), "Hello<|im_end|>"),
        (GenerationConfig(skip_special_tokens=False, ignore_eos=True, max_new_tokens=3), (1, 9, 3), "Hello<|im_end|>ld"),
        (GenerationConfig(skip_special_tokens=False, max_new_tokens=2), (1, 9), "Hello"),  # before the length limit
        (GenerationConfig(skip_special_tokens=False, min_tokens=3, max_new_tokens=5), (1, 9, 3, 9), "Hello<|im_end|>ld"),
    ],
)  # fmt: skip
def test_the_end_of_sequence_that_ends_an_answer_is_not_in_its_text(config, tokens, answer):
    """vLLM's detokenizer leaves out the token that stopped the request (end-of-sequence, as a stop
    token) unless include_stop_str_in_output: with skip_special_tokens false an answer does not end
    with "<|im_end|>", even as the last allowed token; one the answer goes on past (ignore_eos,
    min_tokens) is the answer's, special tokens kept."""
    words = {1: "Hello", 3: "ld", 9: "<|im_end|>"}

    def detokenize(ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join("" if skip_special_tokens and i == 9 else words[i] for i in ids)

    out = OutputText(detokenize, {9}, config, eos_token_id=9)
    assert "".join(out.add(t)[0] for t in tokens) == answer
    assert out.finish_reason
