"""The prefill KV store's two-step handover (prefill_svc/kv_store.py), no gRPC: a leased cache
stays until its decoder confirms receipt, the gateway releases it, or its TTL; bytes are counted
until then and drop exactly once."""

import pytest
import torch

from epd.model_runtime.kv_cache import KvCache
from epd.prefill_svc.kv_store import KvStore, KvStoreStats
from epd.stages.errors import Busy, InvalidRequest, NotFound


def _cache(num_tokens: int = 3) -> KvCache:
    k = torch.arange(2 * num_tokens * 4, dtype=torch.float32).reshape(1, 2, num_tokens, 4)
    return KvCache([k, k + 1], [k + 2, k + 3])


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lease_keeps_the_cache_until_confirmed():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache())
    size = _cache().num_bytes
    first, n1 = store.lease(handle)
    assert n1 == 1 and store.is_leased(handle)
    assert (len(store), store.num_bytes) == (1, size)  # a lease moves no bytes
    # the pull broke: the same cache can be leased again, by anyone
    again, n2 = store.lease(handle)
    assert n2 == 2 and again is first
    assert torch.equal(again.keys[1], _cache().keys[1])
    assert store.confirm(handle) is True
    assert (len(store), store.num_bytes, store.num_confirmed) == (0, 0, 1)
    with pytest.raises(NotFound, match="unknown or expired"):
        store.lease(handle)
    assert store.confirm(handle) is False  # twice: nothing more to drop
    assert store.release(handle) is False  # the gateway's release after the handover is a no-op
    assert store.num_bytes == 0 and store.num_released == 0


def test_release_drops_a_leased_cache():
    """The gateway's release wins over a lease whose decoder never confirms (it died)."""
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache())
    store.lease(handle)
    assert store.release(handle) is True
    assert (len(store), store.num_bytes, store.num_released) == (0, 0, 1)
    assert store.confirm(handle) is False  # a late confirm finds nothing and counts nothing
    assert store.num_confirmed == 0


def test_ttl_ends_a_lease_never_confirmed():
    """A decoder that pulled and died, and a gateway that died too: the TTL frees the bytes."""
    clock = FakeClock()
    store = KvStore(max_bytes=_cache().num_bytes * 2, ttl_s=5, clock=clock)
    leased = store.put(_cache())
    store.lease(leased)
    clock.now = 4.9
    assert len(store) == 1 and store.num_bytes == _cache().num_bytes
    clock.now = 5.0
    assert store.confirm(leased) is False  # too late: expired
    assert (len(store), store.num_bytes, store.num_expired) == (0, 0, 1)


def test_a_leased_cache_counts_against_the_budget():
    store = KvStore(max_bytes=_cache().num_bytes, ttl_s=10)
    handle = store.put(_cache())
    store.lease(handle)
    with pytest.raises(Exception, match="waiting for decoders"):
        store.put(_cache())
    store.confirm(handle)
    store.put(_cache())  # room again once the decoder has it


def test_take_is_lease_and_confirm_at_once():
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(_cache())
    assert store.take(handle).num_cached_tokens == 3
    assert (len(store), store.num_bytes) == (0, 0)
    with pytest.raises(NotFound):
        store.lease(handle)


def test_stats_count_what_is_held_and_what_was_dropped_before_a_decoder_had_it():
    """Its /metrics: held now (caches, bytes, budget); dropped unpulled by reason. A cache whose
    TTL passed counts as expired at the next look, with no put or pull in between."""
    clock = FakeClock()
    size = _cache().num_bytes
    store = KvStore(max_bytes=10 * size, ttl_s=5, clock=clock)
    assert store.stats() == KvStoreStats(
        num_caches=0, num_bytes=0, max_bytes=10 * size, num_expired=0, num_released=0
    )
    confirmed, released, taken, expiring = (store.put(_cache()) for _ in range(4))
    assert store.stats() == KvStoreStats(4, 4 * size, 10 * size, 0, 0)
    store.lease(confirmed)
    store.confirm(confirmed)  # pulled: not a drop
    store.take(taken)  # pulled in-process: not a drop
    store.lease(released)
    store.release(released)  # its request ended before its decoder confirmed
    assert store.stats() == KvStoreStats(1, size, 10 * size, 0, 1)
    clock.now = 5.0
    assert store.stats() == KvStoreStats(0, 0, 10 * size, 1, 1)
    assert store.release(expiring) is False  # already counted as expired, not again as released
    assert store.stats() == KvStoreStats(0, 0, 10 * size, 1, 1)


def test_stats_count_the_caches_refused_for_want_of_room():
    """Each refusal is a request that failed after its prefill ran: its own counter, so an
    operator sees decoders pulling too slowly before users report RESOURCE_EXHAUSTED."""
    size = _cache().num_bytes
    store = KvStore(max_bytes=2 * size, ttl_s=5)
    store.put(_cache())
    store.put(_cache())
    for _ in range(3):
        with pytest.raises(Busy, match="limit"):
            store.put(_cache())
    assert store.stats() == KvStoreStats(2, 2 * size, 2 * size, 0, 0, num_refused=3)


def test_kv_store_release_is_idempotent():
    from epd.model_runtime.kv_cache import KvCache

    k = torch.zeros(1, 2, 3, 4)
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = store.put(KvCache([k, k.clone()], [k.clone(), k.clone()]))
    assert store.release(handle) is True
    assert (len(store), store.num_bytes, store.num_released) == (0, 0, 1)
    assert store.release(handle) is False and store.release("unknown") is False


def test_a_callers_kv_handle_must_be_a_new_random_id():
    from epd.model_runtime.kv_cache import KvCache
    from epd.prefill_svc.kv_store import check_handle

    assert check_handle("") == "" and check_handle("ab" * 16) == "ab" * 16
    for bad in ("x", "AB" * 16, "ab" * 17, "../" * 11):
        with pytest.raises(InvalidRequest, match="32 lowercase hex digits"):
            check_handle(bad)
    store = KvStore(max_bytes=10_000, ttl_s=10)
    k = torch.zeros(1, 2, 3, 4)
    assert store.put(KvCache([k], [k.clone()]), "ab" * 16) == "ab" * 16
    with pytest.raises(InvalidRequest, match="already names a stored KV cache"):
        store.put(KvCache([k], [k.clone()]), "ab" * 16)
