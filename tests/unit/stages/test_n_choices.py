"""OpenAI's and vLLM's `n` (several choices from one prompt) in the bookkeeping, without servers:
each choice's seed and the KV store holding one cache for n decoders."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.sampling import MAX_CHOICES, GenerationConfig, choice_seed
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import ChoiceStart, PrefillHandle
from epd.stages.errors import NotFound


def _cache() -> KvCache:
    k = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    return KvCache([k, k + 1], [k + 2, k + 3])


def test_each_choice_is_seeded_seed_plus_its_index_as_vllm():
    config = GenerationConfig(temperature=1.0, seed=7, n=3)
    assert [config.for_choice(i).seed for i in range(3)] == [7, 8, 9]
    assert {config.for_choice(i).n for i in range(3)} == {1}
    assert GenerationConfig(n=2).for_choice(1).seed is None  # unseeded (greedy): nothing to derive
    # wrapped into the signed 64-bit range a seed takes on the wire
    assert choice_seed(2**63 - 1, 1) == -(2**63)
    assert choice_seed(-1, 1) == 0


def test_n_is_bounded():
    GenerationConfig(n=MAX_CHOICES).validate(32)
    for n in (0, MAX_CHOICES + 1):
        with pytest.raises(ValueError, match=f"n must be between 1 and {MAX_CHOICES}"):
            GenerationConfig(n=n).validate(32)


def test_a_handle_for_each_choice_has_that_choices_first_token():
    handle = PrefillHandle(5, 10, 10, [10] * 4, 100, 1.0, first_text="a", other_choices=[ChoiceStart(6, "b"), ChoiceStart(7, None)])  # fmt: skip
    assert handle.num_choices == 3
    firsts = [(h.first_token_id, h.first_text, h.other_choices) for h in map(handle.for_choice, range(3))]
    assert firsts == [(5, "a", []), (6, "b", []), (7, None, [])]


def test_a_cache_of_n_choices_goes_at_the_nth_confirm_and_counts_its_bytes_once():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache(), num_choices=3)
    assert store.num_bytes == _cache().num_bytes
    for _ in range(2):
        assert store.lease(handle)[1] == 1  # each choice's first pull is no pull again
        assert store.confirm(handle) is True
        assert len(store) == 1  # another choice's decoder has yet to pull it
    store.lease(handle)
    assert store.confirm(handle) is True
    assert (len(store), store.num_bytes, store.num_confirmed) == (0, 0, 1)
    assert store.confirm(handle) is False


def test_a_release_drops_a_cache_of_n_choices_for_all():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache(), num_choices=2)
    store.confirm(handle)
    assert store.release(handle) is True
    assert (len(store), store.num_bytes) == (0, 0)


def test_in_process_takes_of_n_choices_get_their_own_copies():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    cache = _cache()
    handle = store.put(cache, num_choices=2)
    first = store.take(handle)
    assert first is not cache and torch.equal(first.keys[0], cache.keys[0])
    first.keys[0].add_(1)  # a decoder extends what it took; the other choice's copy is untouched
    assert store.take(handle) is cache and torch.equal(cache.keys[0], _cache().keys[0])
    with pytest.raises(NotFound):
        store.take(handle)
