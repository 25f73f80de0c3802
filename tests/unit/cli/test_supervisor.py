"""`epd serve`'s restart bookkeeping (epd/cli/supervisor.py) on a fake clock: backoff, its reset
after a healthy spell, crash loops, health timeouts. The real processes are in
tests/integration/test_supervision.py."""

from __future__ import annotations

import dataclasses

import pytest

from epd.cli.supervisor import Replica, RestartPolicy, State, stage_lost

POLICY = RestartPolicy(
    backoff_initial_s=1.0,
    backoff_max_s=30.0,
    healthy_reset_s=60.0,
    crash_loop_exits=5,
    crash_loop_window_s=60.0,
    health_timeout_s=10.0,
    start_timeout_s=100.0,
)


def serving(now: float = 0.0, policy: RestartPolicy = POLICY) -> Replica:
    replica = Replica("decode[1]", policy, now)
    replica.answered(now, serving=True)
    assert replica.state is State.SERVING
    return replica


def crash_and_restart(replica: Replica, now: float) -> float:
    """It exits at `now` and is restarted when due; the delay it waited."""
    decision = replica.exited(now)
    assert not decision.given_up and replica.state is State.WAITING
    assert not replica.restart_due(now + decision.delay_s - 0.01)
    assert replica.restart_due(now + decision.delay_s)
    replica.restarted(now + decision.delay_s)
    assert replica.state is State.STARTING
    return decision.delay_s


def test_the_backoff_doubles_up_to_its_limit():
    policy = RestartPolicy(crash_loop_exits=100, crash_loop_window_s=1.0)
    replica, now, delays = serving(policy=policy), 0.0, []
    for _ in range(8):
        delays.append(crash_and_restart(replica, now))
        now += delays[-1]
        replica.answered(now, serving=True)
        now += 10.0  # too short a spell to reset the backoff
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert replica.restarts == 8


def test_the_backoff_resets_after_a_healthy_spell():
    replica = serving()
    assert crash_and_restart(replica, 0.0) == 1.0
    replica.answered(2.0, serving=True)
    assert crash_and_restart(replica, 3.0) == 2.0  # 1 s of serving: still backing off
    replica.answered(6.0, serving=True)
    assert crash_and_restart(replica, 6.0 + POLICY.healthy_reset_s) == 1.0  # served 60 s: back to 1 s


def test_a_crash_loop_is_given_up_on():
    replica, now = serving(), 0.0
    for _ in range(POLICY.crash_loop_exits - 1):
        now += crash_and_restart(replica, now)
    decision = replica.exited(now)
    assert decision.given_up and decision.recent_exits == POLICY.crash_loop_exits
    assert replica.state is State.GIVEN_UP and not replica.running
    assert not replica.restart_due(now + 3600.0)
    replica.answered(now + 1.0, serving=True)  # a late health answer does not revive it
    assert replica.state is State.GIVEN_UP


def test_a_port_held_by_another_process_is_waited_for_with_backoff_and_is_no_crash():
    """The gateway's port taken while it was down: the launcher starts nothing and looks again,
    ever less often, for as long as it takes; an exit after that still counts from the backoff."""
    replica = serving()
    now = 0.0
    assert replica.exited(now).delay_s == 1.0
    now += 1.0
    waits = []
    for _ in range(8):
        assert replica.restart_due(now)
        waits.append(replica.port_taken(now))
        assert replica.state is State.WAITING and not replica.restart_due(now + waits[-1] - 0.01)
        now += waits[-1]
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]
    replica.restarted(now)  # the port came free: started again, never given up on meanwhile
    assert replica.state is State.STARTING and replica.restarts == 1


def test_exits_spread_wider_than_the_window_are_not_a_crash_loop():
    replica, now = serving(), 0.0
    for _ in range(3 * POLICY.crash_loop_exits):
        decision = replica.exited(now)
        assert not decision.given_up and decision.recent_exits <= 2
        replica.restarted(now + decision.delay_s)
        now += POLICY.crash_loop_window_s / 2 + 1.0


def test_a_silent_replica_is_flagged_after_the_health_timeout():
    replica = serving(0.0)
    # NOT_SERVING is an answer: alive (the gateway while a stage is down)
    replica.answered(5.0, serving=False)
    assert replica.unresponsive_s(5.0 + POLICY.health_timeout_s) is None
    assert replica.unresponsive_s(5.0 + POLICY.health_timeout_s + 0.5) == pytest.approx(
        POLICY.health_timeout_s + 0.5
    )
    assert replica.state is State.SERVING  # killing it is the caller's; then it reports the exit
    assert replica.exited(16.0).delay_s == 1.0


def test_a_restarted_replica_has_the_start_timeout_to_load_its_model():
    replica = serving(0.0)
    crash_and_restart(replica, 0.0)  # restarted at 1.0
    replica.answered(50.0, serving=False)  # loading: answers NOT_SERVING
    assert replica.state is State.STARTING
    assert replica.unresponsive_s(1.0 + POLICY.start_timeout_s) is None  # silence while starting is fine
    assert replica.unresponsive_s(1.0 + POLICY.start_timeout_s + 1.0) == pytest.approx(
        POLICY.start_timeout_s + 1.0
    )
    replica.answered(60.0, serving=True)
    assert replica.state is State.SERVING and replica.unresponsive_s(65.0) is None


def test_a_restarted_replica_never_asked_is_flagged_at_the_start_timeout_and_backs_off():
    """One moved to a free port that never binds: no health check ever reaches it (its old port is
    another process's), so its start time alone tells; it is killed, waits and crash-loops as any
    replica that is not SERVING in time."""
    policy = dataclasses.replace(POLICY, start_timeout_s=5.0)
    replica, now, delays = serving(policy=policy), 0.0, []
    for _ in range(policy.crash_loop_exits - 1):
        delays.append(crash_and_restart(replica, now))
        started = now + delays[-1]  # never answered after this
        assert replica.unresponsive_s(started + policy.start_timeout_s) is None
        now = started + policy.start_timeout_s + 1.0
        assert replica.unresponsive_s(now) == pytest.approx(policy.start_timeout_s + 1.0)
    assert delays == [1.0, 2.0, 4.0, 8.0]  # the first exit's, then each kill's
    decision = replica.exited(now)
    assert decision.given_up and replica.state is State.GIVEN_UP


def test_a_stage_is_lost_only_when_every_replica_is_given_up():
    one, two = serving(), serving()
    for _ in range(POLICY.crash_loop_exits):
        one.exited(0.0)
    assert one.state is State.GIVEN_UP and not stage_lost([one, two])
    for _ in range(POLICY.crash_loop_exits):
        two.exited(0.0)
    assert stage_lost([one, two])


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"backoff_initial_s": 0.0}, "backoff"),
        ({"backoff_initial_s": 40.0}, "backoff"),
        ({"crash_loop_exits": 0}, "crash loop"),
        ({"health_timeout_s": 0.0}, "--health-timeout"),
        ({"start_timeout_s": 0.0}, "--start-timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_a_policy_that_cannot_work_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**changes)
