"""Plan properties: every target covered exactly once, intervals start on keyframes, balance."""

from __future__ import annotations

import numpy as np
import pytest

from epd.video.plan import assign_intervals, make_intervals


def _random_case(seed: int):
    rng = np.random.default_rng(seed)
    num_frames = int(rng.integers(5, 600))
    # Irregular pts steps (VFR) and irregular keyframe spacing.
    frame_pts = np.cumsum(rng.integers(1, 4, size=num_frames)).astype(np.int64)
    is_key = rng.random(num_frames) < rng.uniform(0.005, 0.3)
    is_key[0] = rng.random() < 0.8  # sometimes the first frame is not flagged
    keyframe_pts = frame_pts[is_key]
    targets = rng.choice(frame_pts, size=int(rng.integers(1, 80)))  # repeats allowed
    return frame_pts, keyframe_pts, targets, float(rng.integers(0, 6)), int(rng.integers(1, 5))


@pytest.mark.parametrize("seed", range(200))
def test_plan_properties(seed):
    frame_pts, keyframe_pts, targets, merge_gap, num_workers = _random_case(seed)
    intervals = make_intervals(frame_pts, keyframe_pts, targets, merge_gap)
    seek_points = set(keyframe_pts.tolist()) | {int(frame_pts[0])}

    covered = [t for iv in intervals for t in iv.target_pts]
    assert sorted(covered) == sorted(set(targets.tolist()))  # every distinct target exactly once
    for position, iv in enumerate(intervals):
        assert iv.position == position
        assert iv.keyframe_pts in seek_points  # starts on a keyframe (or the stream start)
        assert list(iv.target_pts) == sorted(iv.target_pts)
        assert iv.target_pts[0] >= iv.keyframe_pts
        # Cost = frames from the keyframe to the last target, inclusive.
        span = (frame_pts >= iv.keyframe_pts) & (frame_pts <= iv.target_pts[-1])
        assert iv.num_decode_frames == int(span.sum())
        # The keyframe is the latest one at or before the interval's first target.
        later_keys = [k for k in seek_points if iv.keyframe_pts < k <= iv.target_pts[0]]
        assert later_keys == []
    for a, b in zip(intervals, intervals[1:]):
        assert a.target_pts[-1] < b.target_pts[0]  # temporal order, no overlap

    shares = assign_intervals(intervals, num_workers, seek_cost_frames=merge_gap)
    assert len(shares) == num_workers
    assert sorted(p for share in shares for p in share) == list(range(len(intervals)))
    for share in shares:
        assert share == sorted(share)
    loads = [sum(intervals[p].num_decode_frames + merge_gap for p in share) for share in shares]
    if intervals:
        largest = max(iv.num_decode_frames for iv in intervals) + merge_gap
        assert max(loads) - min(loads) <= largest  # balanced by cost, within one interval


def test_targets_in_one_gop_share_one_interval():
    frame_pts = np.arange(100)
    keys = np.array([0, 30, 60, 90])
    intervals = make_intervals(frame_pts, keys, np.array([5, 10, 40, 41, 95]), merge_gap_frames=0)
    assert [(iv.keyframe_pts, iv.target_pts) for iv in intervals] == [
        (0, (5, 10)),
        (30, (40, 41)),
        (90, (95,)),
    ]
    assert [iv.num_decode_frames for iv in intervals] == [11, 12, 6]


def test_close_neighbours_merge_when_decoding_through_is_cheaper():
    frame_pts = np.arange(100)
    keys = np.array([0, 30, 60])
    # Last target 28, next keyframe 30: one frame (29) between them.
    split = make_intervals(frame_pts, keys, np.array([28, 31]), merge_gap_frames=0)
    merged = make_intervals(frame_pts, keys, np.array([28, 31]), merge_gap_frames=1)
    assert len(split) == 2
    assert [(iv.keyframe_pts, iv.target_pts, iv.num_decode_frames) for iv in merged] == [(0, (28, 31), 32)]


def test_single_keyframe_is_one_sequential_interval():
    intervals = make_intervals(np.arange(300), np.array([0]), np.arange(0, 300, 10), 0)
    assert len(intervals) == 1 and intervals[0].num_decode_frames == 291
    assert assign_intervals(intervals, 2) == [[0], []]


def test_assignment_interleaves_equal_intervals_round_robin():
    intervals = make_intervals(np.arange(100), np.arange(0, 100, 10), np.arange(5, 100, 10), 0)
    assert assign_intervals(intervals, 2) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
