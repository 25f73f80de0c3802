"""The prefill scheduler's bookkeeping on plain counters: no model, no torch, no server.

`run_step` plays the runner: every scheduled token is computed, a prefilled request is removed
(as the core does when the runner finishes it)."""

from __future__ import annotations

import sys

import pytest

from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig
from epd.prefill_svc.scheduler import PrefillRequest, PrefillScheduler
from epd.stages.errors import ResourceExhausted


def req(name: str, num_tokens: int, exclusive: bool = False) -> PrefillRequest:
    return PrefillRequest(name, num_prompt_tokens=num_tokens, exclusive=exclusive)


def scheduler(budget: int = 100, chunk: int | None = 40, max_requests: int = 8, max_tokens: int = 1000):
    return PrefillScheduler(PrefillSchedulerConfig(budget, chunk, max_requests, max_tokens))


def run_step(s: PrefillScheduler) -> list[tuple[str, int]]:
    """One step: (request, tokens scheduled) in batch order; computes them, removes the done."""
    batch = s.schedule()
    step = [(r.request_id, r.num_scheduled_tokens) for r in batch]
    for r in batch:
        r.step_done()
        if r.is_prefilled:
            s.remove(r)
    return step


def drain(s: PrefillScheduler, max_steps: int = 100) -> list[list[tuple[str, int]]]:
    steps = []
    while s.requests():
        steps.append(run_step(s))
        assert len(steps) <= max_steps, "the scheduler stopped making progress"
    return steps


def test_short_prompts_share_a_step_up_to_the_token_budget():
    s = scheduler(budget=100, chunk=40)
    for name, n in [("a", 30), ("b", 30), ("c", 30), ("d", 30)]:
        s.add(req(name, n))
    assert drain(s) == [[("a", 30), ("b", 30), ("c", 30)], [("d", 30)]]
    assert s.num_queued_tokens == 0


def test_a_long_prompt_runs_in_chunks_and_the_prompts_behind_it_do_not_wait_for_it():
    s = scheduler(budget=100, chunk=40)
    s.add(req("video", 130))
    s.add(req("q1", 30))
    s.add(req("q2", 30))
    s.add(req("q3", 30))
    steps = drain(s)
    assert steps[0] == [("video", 40), ("q1", 30), ("q2", 30)]  # q2 done before the video's 2nd chunk
    assert steps[1] == [("video", 40), ("q3", 30)]
    assert steps[2:] == [[("video", 40)], [("video", 10)]]
    assert sum(n for step in steps for name, n in step if name == "video") == 130


def test_the_request_state_counts_the_tokens_done():
    s = scheduler(budget=100, chunk=40)
    video = req("video", 90)
    s.add(video)
    run_step(s)
    assert (video.num_computed_tokens, video.num_remaining_tokens, video.is_prefilled) == (40, 50, False)
    assert s.running == [video] and not s.waiting
    run_step(s)
    run_step(s)
    assert (video.num_computed_tokens, video.is_prefilled) == (90, True)
    assert not s.requests()


def test_no_step_exceeds_the_budget_and_order_is_first_come():
    s = scheduler(budget=64, chunk=32)
    sizes = [5, 70, 12, 33, 64, 1, 100, 8]
    for i, n in enumerate(sizes):
        s.add(req(f"r{i}", n))
    steps = drain(s)
    assert all(sum(n for _, n in step) <= 64 for step in steps)
    first_seen = []
    for step in steps:
        first_seen += [name for name, _ in step if name not in first_seen]
    assert first_seen == [f"r{i}" for i in range(len(sizes))]
    done = {f"r{i}": 0 for i in range(len(sizes))}
    for step in steps:
        for name, n in step:
            done[name] += n
    assert done == {f"r{i}": n for i, n in enumerate(sizes)}


def test_a_whole_prompt_that_does_not_fit_waits_for_the_next_step_first():
    s = scheduler(budget=100, chunk=60)
    s.add(req("a", 60))
    s.add(req("b", 50))  # does not fit the 40 left: first of the next step, not skipped
    s.add(req("c", 10))
    assert drain(s) == [[("a", 60)], [("b", 50), ("c", 10)]]


def test_without_chunking_a_prompt_over_the_budget_runs_alone():
    s = scheduler(budget=100, chunk=None)
    s.add(req("a", 20))
    s.add(req("huge", 250))
    s.add(req("b", 20))
    assert drain(s) == [[("a", 20)], [("huge", 250)], [("b", 20)]]


def test_an_exclusive_request_runs_whole_and_alone():
    s = scheduler(budget=100, chunk=40)
    s.add(req("a", 30))
    s.add(req("pruned", 300, exclusive=True))
    s.add(req("b", 30))
    assert drain(s) == [[("a", 30)], [("pruned", 300)], [("b", 30)]]


def test_an_exclusive_request_waits_for_the_chunks_already_started():
    s = scheduler(budget=100, chunk=40)
    s.add(req("video", 100))
    s.add(req("pruned", 20, exclusive=True))
    assert drain(s) == [[("video", 40)], [("video", 40)], [("video", 20)], [("pruned", 20)]]


def test_the_request_bound_says_what_is_full_and_which_flag_raises_it():
    s = scheduler(max_requests=2)
    s.add(req("a", 10))
    s.add(req("b", 10))
    with pytest.raises(ResourceExhausted, match=r"2 requests are waiting.*--max-waiting-prefills"):
        s.add(req("c", 10))
    assert [r.request_id for r in s.requests()] == ["a", "b"]  # nothing admitted is dropped


def test_the_token_bound_says_what_is_full_and_which_flag_raises_it():
    s = scheduler(max_tokens=100)
    s.add(req("a", 60))
    with pytest.raises(
        ResourceExhausted, match=r"60 prompt tokens are waiting.*adds 50.*--max-waiting-prompt-tokens"
    ):
        s.add(req("b", 50))
    s.add(req("c", 40))  # exactly at the bound
    assert s.num_queued_tokens == 100


def test_removal_frees_the_queue_place_and_tokens_at_once():
    s = scheduler(budget=100, chunk=40, max_requests=2, max_tokens=200)
    a, b = req("a", 100), req("b", 100)
    s.add(a)
    s.add(b)
    with pytest.raises(ResourceExhausted):
        s.add(req("c", 10))
    s.remove(b)  # cancelled while waiting
    assert s.num_queued_tokens == 100 and list(s.waiting) == [a]
    s.add(req("c", 100))
    run_step(s)  # a is part-way (chunked)
    s.remove(a)  # cancelled while running
    s.remove(a)  # removing twice is harmless
    assert a not in s.requests() and s.num_queued_tokens == 100
    assert [r.request_id for r in s.schedule()] == ["c"]


def test_load_counts_waiting_and_running():
    s = scheduler(budget=100, chunk=40)
    s.add(req("video", 100))
    s.add(req("a", 30))
    s.add(req("b", 40))  # a whole prompt over the 30 tokens left
    s.schedule()
    load = s.load()
    assert (load.stage, load.num_running, load.num_waiting) == ("prefill", 2, 1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_prefill_tokens_per_step": 0}, "--max-prefill-tokens-per-step"),
        ({"max_prefill_tokens_per_step": 100, "prefill_chunk_tokens": 101}, "--prefill-chunk-tokens"),
        ({"max_waiting_prefills": 0}, "--max-waiting-prefills"),
    ],
)
def test_bad_settings_name_their_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefillSchedulerConfig(**kwargs)


def test_a_token_bound_below_the_prompt_limit_is_refused():
    with pytest.raises(ValueError, match="--max-waiting-prompt-tokens"):
        PrefillConfig(max_prompt_tokens=1000, scheduler=PrefillSchedulerConfig(max_waiting_prompt_tokens=999))


def test_the_scheduler_module_needs_no_torch():
    import subprocess

    code = "import sys, epd.prefill_svc.scheduler; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
