"""Media affinity (`epd.transport.affinity`): rendezvous order by media sha256 over the healthy
replicas (an overloaded home last), the least loaded replica without one (ties in turn),
replicas added and removed; pure bookkeeping, no gRPC."""

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
    # A replica that was unreachable rejoins as soon as a health check finds it SERVING ...
    chooser.mark_failed(order[0])
    chooser.set_serving(order[0], True)
    assert chooser.order(key) == order
    # ... one that hung does not (answering health checks says nothing about answering calls).
    chooser.mark_failed(order[0], hung=True)
    chooser.set_serving(order[0], True)
    assert chooser.order(key)[0] == order[1]
    now[0] += 5.1
    assert chooser.order(key) == order
    # A check that says not serving keeps it down whatever the hold.
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


def test_without_a_key_the_least_loaded_healthy_replica_goes_first_ties_in_turn():
    chooser = ReplicaChooser(["a", "b", "c"])
    chooser.set_load("a", 3)
    chooser.set_load("b", 0)
    chooser.set_load("c", 1)
    assert [chooser.order()[0] for _ in range(3)] == ["b", "b", "b"]
    assert chooser.order() == ["b", "c", "a"]
    chooser.set_load("c", 0)
    assert {chooser.order()[0] for _ in range(4)} == {"b", "c"}  # a tie: in turn
    # Our own calls in flight count as soon as they start, before the next load report.
    for _ in range(2):
        chooser.begin("b")
    assert [chooser.order()[0] for _ in range(3)] == ["c", "c", "c"]
    assert chooser.load("b") == 2 and chooser.in_flight("b") == 2
    chooser.end("b")
    chooser.end("b")
    assert chooser.load("b") == 0 and chooser.in_flight("b") == 0
    # A report larger than our calls wins (another gateway's work); no report: our calls only.
    chooser.set_load("c", 9)
    chooser.set_load("a", None)
    assert chooser.order()[0] in {"a", "b"} and chooser.order()[-1] == "c"
    # A replica down is last whatever its load.
    chooser.set_serving("a", False)
    chooser.set_serving("b", False)
    assert chooser.order() == ["c", "a", "b"] or chooser.order() == ["c", "b", "a"]


def test_a_keyed_call_stays_home_under_some_load_and_leaves_an_overloaded_home():
    chooser = ReplicaChooser(REPLICAS, max_excess_load=4)
    key = KEYS[5]
    order = rendezvous_order(key, REPLICAS)
    chooser.set_load(order[0], 4)  # 4 more than the idle others: still home (the cache is there)
    assert chooser.order(key) == order
    chooser.set_load(order[0], 5)  # beyond the slack: the next choice, home tried last
    assert chooser.order(key) == [order[1], order[2], order[0]]
    chooser.set_load(order[1], 3)  # the spill goes by rendezvous order, not by load
    assert chooser.order(key) == [order[1], order[2], order[0]]
    chooser.set_load(order[1], 5)
    chooser.set_load(order[2], 5)  # all equally busy: home again
    assert chooser.order(key) == order


def test_round_robin_routing_ignores_keys_and_loads():
    chooser = ReplicaChooser(["a", "b"], routing="round-robin")
    chooser.set_load("a", 50)
    assert [chooser.order(KEYS[0])[0] for _ in range(4)] == ["a", "b", "a", "b"]
    chooser.set_serving("a", False)
    assert [chooser.order(KEYS[0]) for _ in range(2)] == [["b", "a"], ["b", "a"]]
    with pytest.raises(ValueError, match="routing must be one of"):
        ReplicaChooser(["a"], routing="random")


def test_replicas_come_and_go_and_keys_move_only_to_or_from_them():
    chooser = ReplicaChooser(REPLICAS[:2])
    homes = {k: chooser.order(k)[0] for k in KEYS}
    chooser.mark_failed(REPLICAS[1])
    chooser.set_load(REPLICAS[1], 7)
    added, removed = chooser.set_replicas(REPLICAS)
    assert (added, removed) == ([REPLICAS[2]], [])
    assert not chooser.is_healthy(REPLICAS[1]) and chooser.load(REPLICAS[1]) == 7  # kept
    chooser.set_serving(REPLICAS[1], True)
    chooser.set_load(REPLICAS[1], 0)
    moved = {k for k in KEYS if chooser.order(k)[0] != homes[k]}
    assert moved and all(chooser.order(k)[0] == REPLICAS[2] for k in moved)
    added, removed = chooser.set_replicas([REPLICAS[0], REPLICAS[2]])
    assert (added, removed) == ([], [REPLICAS[1]])
    assert REPLICAS[1] not in chooser.order() and chooser.load(REPLICAS[1]) == 0
    with pytest.raises(ValueError, match="at least one address"):
        chooser.set_replicas([])


def test_a_stage_needs_a_replica():
    with pytest.raises(ValueError, match="at least one address"):
        ReplicaChooser([])


def test_a_conversations_key_is_its_opening_and_its_tenants():
    from epd.stages.messages import Message
    from epd.transport.affinity import conversation_key

    first = [Message.system("be brief"), Message.user("hello", "there")]
    later = [*first, Message.assistant("hi"), Message.user("what now?")]
    assert conversation_key(first) == conversation_key(later)  # every turn finds the first's home
    assert conversation_key(first, "tenant-a") != conversation_key(first, "tenant-b")
    assert conversation_key(first) != conversation_key(
        [Message.system("be brief"), Message.user("hellothere")]
    )
    assert conversation_key(first) != conversation_key([Message.user("hello", "there")])


def test_the_prefill_key_is_the_video_only_for_a_conversation_that_opens_with_it():
    """Where the prefix cache can hit (docs/architecture.md, "Prefix cache"): a conversation that
    opens with its video shares its prompt through the video with others about it (the video's
    sha256); one whose video comes after text-only turns reuses those turns' KV (its opening)."""
    from epd.stages.messages import IMAGE, VIDEO, Message, media_in_opening
    from epd.transport.affinity import conversation_key, prefill_key

    sha = "ab" * 32
    opens = [Message.system("be brief"), Message.user("look:", VIDEO, "what moves?")]
    assert media_in_opening(opens) and prefill_key(opens, sha) == sha
    follow_up = [*opens, Message.assistant("a square"), Message.user("what colour?")]
    assert prefill_key(follow_up, sha, "tenant") == sha  # every turn, and every conversation about it
    later = [Message.user("hello"), Message.assistant("hi"), Message.user(IMAGE, "and this?")]
    assert not media_in_opening(later)
    assert (
        prefill_key(later, sha, "tenant")
        == conversation_key(later[:1], "tenant")
        == prefill_key(later[:1], "", "tenant")
    )
    assert prefill_key(opens) == conversation_key(opens)  # media the gateway could not hash: its opening
    assert not media_in_opening([Message.user("text alone")])


def test_a_raw_prompt_has_a_home_of_its_own_and_shares_it_with_prompts_that_begin_alike():
    """A raw prompt's affinity key (`raw_prompt_key`): never a conversation's, one per tenant, and
    the same for prompts whose first RAW_PROMPT_KEY_CHARS characters agree (a shared preamble)."""
    from epd.stages.messages import Message
    from epd.stages.raw_prompt import RawPrompt
    from epd.transport.affinity import RAW_PROMPT_KEY_CHARS, conversation_key, raw_prompt_key

    text = "hello"
    assert raw_prompt_key(RawPrompt(text)) != conversation_key([Message.user(text)])
    assert raw_prompt_key(RawPrompt(text)) != raw_prompt_key(RawPrompt(text), salt="tenant")
    assert raw_prompt_key(RawPrompt(token_ids=(1, 2))) != raw_prompt_key(RawPrompt("1,2"))
    preamble = "p" * RAW_PROMPT_KEY_CHARS
    assert raw_prompt_key(RawPrompt(preamble + "a")) == raw_prompt_key(RawPrompt(preamble + "b"))
    assert raw_prompt_key(RawPrompt("a" + preamble)) != raw_prompt_key(RawPrompt("b" + preamble))
