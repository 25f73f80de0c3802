"""Questions about a `Scene` and their one-word answers.

Each clip gets at most one question of each type; a type is skipped when the scene can't answer it
without ambiguity (no shape that only one object has; entries too close together to order). What
each type asks, and the answer words:

| question_type | example | answers |
|---|---|---|
| colour | what colour is the circle? | a colour (the only object of that shape) |
| shape | what shape is the red object? | circle, square, triangle |
| count | how many objects appear in the video? | one .. five (distinct objects over the clip) |
| direction | which direction does the red object move? | left, right, up, down (main axis) |
| first | which object appears first? | the colour of the earliest to appear |
| last | which object appears last? | the colour of the latest to appear |
| enters | does the red object enter the video? | yes if it is absent on the first frame |
| leaves | does the red object leave the video? | yes if it is absent on the last frame |
| end | what happens at the end of the video? | enters, leaves, stops (see `epd.synth.scene`) |

Images get colour, shape and count. Objects are named by colour (unique in a clip) or by a shape
that only one object has. Every answer is in `ANSWER_VOCAB`: lowercase ASCII words, so a small BPE
tokenizer holds each as one or two tokens. Template and target choices come from a generator of
their own, seeded by the scene's seed, so questions are as reproducible as pixels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from epd.synth.scene import COLOURS, DIRECTIONS, END_EVENTS, SHAPES, ObjectSpec, Scene

NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five")
YES_NO: tuple[str, ...] = ("yes", "no")
ANSWER_VOCAB: tuple[str, ...] = (
    *COLOURS,
    *SHAPES,
    *NUMBER_WORDS[1:],
    *DIRECTIONS,
    *YES_NO,
    *END_EVENTS,
)
VIDEO_QUESTION_TYPES: tuple[str, ...] = (
    "colour",
    "shape",
    "count",
    "direction",
    "first",
    "last",
    "enters",
    "leaves",
    "end",
)
IMAGE_QUESTION_TYPES: tuple[str, ...] = ("colour", "shape", "count")

# Templates per question type. `{shape}` / `{colour}` name the target object.
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "colour": ("what colour is the {shape}?", "what color is the {shape}?"),
    "shape": ("what shape is the {colour} object?", "what is the shape of the {colour} object?"),
    "count": ("how many objects appear in the video?", "how many objects are there in the video?"),
    "direction": (
        "which direction does the {colour} object move?",
        "which way does the {colour} object move?",
    ),
    "first": ("which object appears first?", "which object is seen first?"),
    "last": ("which object appears last?", "which object is seen last?"),
    "enters": ("does the {colour} object enter the video?", "does the {colour} object enter later?"),
    "leaves": ("does the {colour} object leave the video?", "does the {colour} object leave before the end?"),
    "end": ("what happens at the end of the video?", "what happens at the end?"),
}
_IMAGE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "colour": ("what colour is the {shape}?", "what color is the {shape} in the image?"),
    "shape": ("what shape is the {colour} object?", "what is the shape of the {colour} object?"),
    "count": ("how many objects are there in the image?", "how many objects are in the image?"),
}
_QUESTION_STREAM = 0x0A5C  # mixed into the seed: question draws never shift scene draws


@dataclass(frozen=True)
class QA:
    """One question about one media file."""

    question: str
    answer: str
    question_type: str  # one of VIDEO_QUESTION_TYPES


def tokenizer_words() -> list[str]:
    """Every word a question or answer can contain, for a tokenizer's training corpus."""
    words = set(ANSWER_VOCAB)
    for templates in (*_TEMPLATES.values(), *_IMAGE_TEMPLATES.values()):
        for t in templates:
            words.update(t.replace("{shape}", "").replace("{colour}", "").replace("?", " ").split())
    return sorted(words)


def make_questions(scene: Scene, min_order_gap_frames: int | None = None) -> list[QA]:
    """The questions this scene answers without ambiguity, in VIDEO_QUESTION_TYPES order."""
    rng = np.random.default_rng([scene.seed, _QUESTION_STREAM])
    templates = _IMAGE_TEMPLATES if scene.is_image else _TEMPLATES
    gap = min_order_gap_frames
    if gap is None:
        gap = scene.config.frames(scene.config.min_order_gap_s)
    out: list[QA] = []
    for qtype in IMAGE_QUESTION_TYPES if scene.is_image else VIDEO_QUESTION_TYPES:
        made = _ASK[qtype](scene, rng, gap)
        if made is None:
            continue
        slots, answer = made
        template = templates[qtype][int(rng.integers(len(templates[qtype])))]
        out.append(QA(template.format(**slots), answer, qtype))
    return out


_Made = tuple[dict[str, str], str] | None


def _ask_colour(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    shapes = [o.shape for o in scene.objects]
    unique = [s for s in SHAPES if shapes.count(s) == 1]
    if not unique:
        return None
    shape = unique[int(rng.integers(len(unique)))]
    obj = next(o for o in scene.objects if o.shape == shape)
    return {"shape": shape}, obj.colour


def _ask_shape(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    return {"colour": obj.colour}, obj.shape


def _ask_count(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    return {}, NUMBER_WORDS[len(scene.objects)]


def _ask_direction(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    obj = scene.objects[int(rng.integers(len(scene.objects)))]
    return {"colour": obj.colour}, obj.direction


def _ask_first(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    order = sorted(scene.objects, key=lambda o: o.enter_frame)
    if len(order) < 2 or order[1].enter_frame - order[0].enter_frame < gap:
        return None
    return {}, order[0].colour


def _ask_last(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    order = sorted(scene.objects, key=lambda o: o.enter_frame)
    if len(order) < 2 or order[-1].enter_frame - order[-2].enter_frame < gap:
        return None
    return {}, order[-1].colour


def _enters(o: ObjectSpec) -> bool:
    return o.enter_frame > 0


def _leaves(o: ObjectSpec, num_frames: int) -> bool:
    return o.exit_frame < num_frames


def _ask_yes_no(scene: Scene, rng: np.random.Generator, has: Callable[[ObjectSpec], bool]) -> _Made:
    """Pick the target so that yes and no are equally likely wherever both exist."""
    want_yes = bool(rng.random() < 0.5)
    pool = [o for o in scene.objects if has(o) == want_yes] or list(scene.objects)
    obj = pool[int(rng.integers(len(pool)))]
    return {"colour": obj.colour}, "yes" if has(obj) else "no"


def _ask_enters(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    return _ask_yes_no(scene, rng, _enters)


def _ask_leaves(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    return _ask_yes_no(scene, rng, lambda o: _leaves(o, scene.num_frames))


def _ask_end(scene: Scene, rng: np.random.Generator, gap: int) -> _Made:
    return ({}, scene.end_event) if scene.end_event else None


_ASK = {
    "colour": _ask_colour,
    "shape": _ask_shape,
    "count": _ask_count,
    "direction": _ask_direction,
    "first": _ask_first,
    "last": _ask_last,
    "enters": _ask_enters,
    "leaves": _ask_leaves,
    "end": _ask_end,
}
