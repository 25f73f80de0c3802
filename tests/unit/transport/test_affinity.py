"""Media affinity (`epd.transport.affinity`): rendezvous order by media sha256 over the healthy
replicas, round robin without one; pure bookkeeping, no gRPC."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from epd.transport.affinity import ReplicaChooser, rendezvous_order, rendezvous_score

REPLICAS = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(3000)]


def home(key: str, replicas: list[str]) -> str:
    return rendezvous_order(key, replicas)[0]


def test_the_order_is_stable_and_independent_of_the_listing_order():
    for key in KEYS[:50]:
        order = rendezvous_order(key, REPLICAS)
        assert sorted(order) == sorted(REPLICAS)
        assert rendezvous_order(key, list(reversed(REPLICAS))) == order
        assert rendezvous_order(key, REPLICAS) == order
    # The same in every process: a pinned value (blake2b, not Python's salted hash()).
    assert rendezvous_score("abc", "r") == rendezvous_score("abc", "r")
    assert rendezvous_order(KEYS[0], ["a", "b"]) == rendezvous_order(KEYS[0], ["b", "a"])


def test_keys_spread_evenly_over_the_replicas():
    counts = Counter(home(k, REPLICAS) for k in KEYS)
    assert set(counts) == set(REPLICAS)
    for replica in REPLICAS:
        assert 0.28 < counts[replica] / len(KEYS) < 0.39, counts


def test_adding_a_replica_moves_only_the_keys_it_now_wins():
    grown = [*REPLICAS, "10.0.0.4:50052"]
    moved = [k for k in KEYS if home(k, REPLICAS) != home(k, grown)]
    assert all(home(k, grown) == "10.0.0.4:50052" for k in moved)
    assert 0.20 < len(moved) / len(KEYS) < 0.30  # its fair share, 1/4


def test_losing_a_replica_moves_only_its_keys_each_to_its_second_choice():
    lost = REPLICAS[1]
    rest = [r for r in REPLICAS if r != lost]
    for key in KEYS:
        before = rendezvous_order(key, REPLICAS)
        after = home(key, rest)
        if before[0] == lost:
            assert after == before[1]
        else:
            assert after == before[0]


def test_the_chooser_routes_a_key_home_and_around_a_replica_that_is_down():
    chooser = ReplicaChooser(REPLICAS)
    key = KEYS[7]
    order = rendezvous_order(key, REPLICAS)
    assert chooser.order(key) == order
    assert chooser.order(key) == order  # no turn taken by keyed calls
    chooser.set_serving(order[0], False)
    assert chooser.order(key) == [order[1], order[2], order[0]]  # the down one is only the last resort
    chooser.set_serving(order[0], True)
    assert chooser.order(key) == order
    chooser.set_serving("not-a-replica:1", False)  # ignored
    assert chooser.order(key) == order


def test_a_failed_call_holds_a_replica_back_for_a_while():
    now = [100.0]
    chooser = ReplicaChooser(REPLICAS, failure_hold_s=5.0, clock=lambda: now[0])
    key = KEYS[3]
    order = rendezvous_order(key, REPLICAS)
    chooser.mark_failed(order[0])
    assert chooser.order(key)[0] == order[1]
    now[0] += 4.9
    assert chooser.order(key)[0] == order[1]
    now[0] += 0.2
    assert chooser.order(key) == order
    # A health check that says serving does not cut a failure's hold short, nor the reverse.
    chooser.mark_failed(order[0])
    chooser.set_serving(order[0], True)
    assert chooser.order(key)[0] == order[1]
    now[0] += 6
    chooser.set_serving(order[0], False)
    assert chooser.order(key)[0] == order[1]


def test_without_a_key_calls_go_round_robin_over_the_healthy_replicas():
    chooser = ReplicaChooser(["a", "b", "c"])
    assert [chooser.order()[0] for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert chooser.order() == ["b", "c", "a"]
    chooser.set_serving("b", False)
    firsts = [chooser.order()[0] for _ in range(6)]
    assert sorted(Counter(firsts).items()) == [("a", 3), ("c", 3)]
    assert all(o[-1] == "b" for o in (chooser.order() for _ in range(3)))
    for r in ("a", "c"):
        chooser.set_serving(r, False)
    assert {chooser.order()[0] for _ in range(3)} == {"a", "b", "c"}  # all down: still all tried


def test_a_stage_needs_a_replica():
    with pytest.raises(ValueError, match="at least one address"):
        ReplicaChooser([])
