"""From a sampling request to keyframe-aligned decode intervals dealt out to workers (pure functions).

1. `select_frames` (the rule in `epd.video.types`) picks one frame pts per output slot.
2. `make_intervals` groups the distinct picked frames by the keyframe at or before each: one
   interval per keyframe, from that keyframe (where a worker seeks) to its last target (where the
   worker stops). Neighbouring intervals are merged when the frames between them are fewer than
   a seek costs, since decoding through is then cheaper than seeking.
3. `assign_intervals` deals the intervals, in temporal order, each to the worker whose share is
   cheapest so far. Cost is frames to decode, not interval count. Dealing in temporal order
   interleaves the shares, so the earliest frames are ready first (good for overlap with
   encoding), and the shares differ by at most one interval's cost.

A video with a single keyframe (or no seek index) becomes one interval: a sequential decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epd.video.keyframe_index import VideoIndex
from epd.video.simple_decoder import select_frames
from epd.video.types import SamplingOptions


@dataclass(frozen=True)
class Interval:
    """A run of frames one worker decodes after one seek."""

    position: int
    """Temporal rank among the plan's intervals (0 = earliest)."""
    keyframe_pts: int
    """Stream pts of the keyframe the worker seeks to."""
    target_pts: tuple[int, ...]
    """Distinct stream pts of the frames to keep, ascending, all >= keyframe_pts."""
    num_decode_frames: int
    """Frames decoded from the keyframe to the last target inclusive: the interval's cost."""


@dataclass(frozen=True)
class DecodePlan:
    slot_pts: np.ndarray
    """[T] int64 stream pts of the frame for each output slot, in time order (repeats allowed)."""
    sampled_fps: float
    intervals: list[Interval]
    """All intervals, in temporal order; every distinct slot pts is in exactly one."""
    shares: list[list[int]]
    """shares[w] = positions of the intervals worker w decodes, ascending. Empty shares allowed."""

    @property
    def num_decode_frames(self) -> int:
        """Frames that must be decoded: the numerator of the decode floor."""
        return sum(iv.num_decode_frames for iv in self.intervals)


def make_plan(
    index: VideoIndex,
    opts: SamplingOptions,
    num_workers: int,
    seek_cost_frames: float = 3.0,
) -> DecodePlan:
    """The whole planning step for one request."""
    chosen_s, sampled_fps = select_frames(index.frames, opts)
    # Back from seconds to stream pts: chosen_s are elements of index.frames.pts_s.
    pos = np.searchsorted(index.frames.pts_s, chosen_s)
    slot_pts = index.frame_pts[pos]
    intervals = make_intervals(index.frame_pts, index.keyframe_pts, slot_pts, seek_cost_frames)
    shares = assign_intervals(intervals, num_workers, seek_cost_frames)
    return DecodePlan(slot_pts, sampled_fps, intervals, shares)


def make_intervals(
    frame_pts: np.ndarray,
    keyframe_pts: np.ndarray,
    target_pts: np.ndarray,
    merge_gap_frames: float = 3.0,
) -> list[Interval]:
    """Group distinct targets by their keyframe; merge neighbours separated by few frames.

    frame_pts: [N] sorted pts of every frame; keyframe_pts: [K] sorted, keyframe_pts[0] <=
    frame_pts[0] is not required (a target before every keyframe uses the first frame as its
    seek point, i.e. the start of the stream).
    """
    targets = np.unique(np.asarray(target_pts, np.int64))
    if len(targets) == 0:
        return []
    starts = np.asarray(keyframe_pts, np.int64)
    if len(starts) == 0 or starts[0] > frame_pts[0]:
        starts = np.concatenate([np.asarray(frame_pts[:1], np.int64), starts])
    key_of = starts[np.searchsorted(starts, targets, side="right") - 1]  # [T'] keyframe per target

    groups: list[tuple[int, list[int]]] = []  # (keyframe pts, targets)
    for key, target in zip(key_of.tolist(), targets.tolist()):
        if groups and groups[-1][0] == key:
            groups[-1][1].append(target)
            continue
        if groups:
            # Frames strictly between the previous group's last target and this keyframe.
            prev_last = groups[-1][1][-1]
            gap = int(np.searchsorted(frame_pts, key) - np.searchsorted(frame_pts, prev_last, "right"))
            if gap <= merge_gap_frames:
                groups[-1][1].append(target)
                continue
        groups.append((key, [target]))

    intervals = []
    for position, (key, group) in enumerate(groups):
        cost = int(np.searchsorted(frame_pts, group[-1], "right") - np.searchsorted(frame_pts, key))
        intervals.append(Interval(position, key, tuple(group), max(cost, 1)))
    return intervals


def assign_intervals(
    intervals: list[Interval], num_workers: int, seek_cost_frames: float = 3.0
) -> list[list[int]]:
    """Deal intervals in temporal order, each to the least-loaded worker (ties: lowest id)."""
    num_workers = max(1, num_workers)
    loads = [0.0] * num_workers
    shares: list[list[int]] = [[] for _ in range(num_workers)]
    for interval in intervals:
        worker = min(range(num_workers), key=lambda w: (loads[w], w))
        shares[worker].append(interval.position)
        loads[worker] += interval.num_decode_frames + seek_cost_frames
    return shares
