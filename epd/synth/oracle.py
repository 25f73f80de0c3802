"""Answer a dataset question from decoded pixels alone: the reference the labels are checked against.

`answer_from_frames(frames, question_type, question)` reads the target (a colour or shape word)
from the question text and the facts from `epd.synth.measure` tracks. It never sees the `Scene`, so
when it agrees with a label, the label is true of the video as a viewer (or a model) receives it.
`python -m epd.synth.dataset --audit` and the unit tests run it over generated clips.

Conventions it shares with the generator (they are the meaning of the questions, not labels):
the end window is the last third of the frames; "enters" means absent on the first frame and
seen later; "leaves" means seen and then absent on the last frame.
"""

from __future__ import annotations

import math

import numpy as np

from epd.synth.measure import Track, track_objects
from epd.synth.questions import NUMBER_WORDS
from epd.synth.scene import COLOURS, SHAPES

# A track whose centroid moves less than this between frames in the end window counts as still.
STILL_STEP_PX = 1.0


def answer_from_frames(frames: np.ndarray, question_type: str, question: str) -> str:
    """The answer the pixels `frames` [T, H, W, 3] give; "unknown" where they don't settle it."""
    return answer_from_tracks(track_objects(frames), len(frames), question_type, question)


def answer_from_tracks(tracks: dict[str, Track], num_frames: int, question_type: str, question: str) -> str:
    """`answer_from_frames` on tracks measured once (several questions about one clip)."""
    words = question.rstrip("?").split()
    colour = next((w for w in words if w in COLOURS), None)
    shape = next((w for w in words if w in SHAPES), None)
    target = tracks.get(colour) if colour else None
    if question_type == "count":
        return NUMBER_WORDS[len(tracks)] if len(tracks) < len(NUMBER_WORDS) else "unknown"
    if question_type == "colour":
        matches = [t.colour for t in tracks.values() if t.shape == shape]
        return matches[0] if len(matches) == 1 else "unknown"
    if question_type in ("first", "last"):
        return _order(tracks, question_type)
    if question_type == "end":
        return _end_event(tracks, num_frames)
    if target is None:
        return "unknown"
    if question_type == "shape":
        return target.shape
    if question_type == "direction":
        return target.direction()
    if question_type == "enters":
        return "yes" if target.first_frame > 0 else "no"
    if question_type == "leaves":
        return "yes" if target.last_frame < num_frames - 1 else "no"
    raise ValueError(f"unknown question_type {question_type!r}")


def _order(tracks: dict[str, Track], which: str) -> str:
    firsts = sorted((t.first_frame, t.colour) for t in tracks.values())
    if len(firsts) < 2:
        return "unknown"
    if which == "first":
        return firsts[0][1] if firsts[0][0] < firsts[1][0] else "unknown"
    return firsts[-1][1] if firsts[-1][0] > firsts[-2][0] else "unknown"


def _end_event(tracks: dict[str, Track], num_frames: int) -> str:
    window = math.ceil(2 * num_frames / 3)
    # One frame of slack: an exit at the window's edge shows as a last sighting just before it.
    entered = [t for t in tracks.values() if t.first_frame >= window - 1]
    left = [t for t in tracks.values() if window - 1 <= t.last_frame < num_frames - 1]
    if len(entered) == 1 and not left:
        return "enters"
    if len(left) == 1 and not entered:
        return "leaves"
    if entered or left:
        return "unknown"
    in_window = [t for t in tracks.values() if t.last_frame >= window]
    if in_window and all(t.max_step_px(window) < STILL_STEP_PX for t in in_window):
        return "stops"
    return "unknown"
