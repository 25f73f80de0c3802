"""A seeded description of one synthetic clip: background, objects, their paths and timings.

Everything downstream (pixels, questions, answers) is a pure function of a `Scene`, and a `Scene`
is a pure function of `(seed, SceneConfig)`: `generate_scene(seed)` draws every random choice from
one `numpy.random.Generator` seeded with `seed`, so a seed names a clip.

Time is counted in frames. An object is visible on frames `enter_frame <= f < exit_frame`, it moves
in a straight line from `start_xy` to `end_xy` between `move_start_frame` and `move_end_frame`,
and it holds still outside that span. Objects pop in and out (no sliding across the border), so an
object that is visible is always whole: colour, shape and centroid can be read from any frame.

The clip is split into a body and an *end window*: the last third, frames `[end_window_start, N)`.
Each clip has exactly one `end_event`, which is what "what happens at the end?" asks about:
- "enters": one object appears inside the end window; nothing leaves there.
- "leaves": one object disappears inside the end window; nothing enters there.
- "stops": nothing enters or leaves there, and every object stands still through the window
  (they all moved before it).
Entries and exits in the body are kept `event_margin_s` away from the start and from the window, so
that frames sampled at 2 fps (what the serving path feeds the model) still tell them apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Object colours. Saturated or bright, and far (in RGB) from every background, which is dark and
# nearly grey, so a decoded pixel can be told apart after H.264 with 4:2:0 chroma.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 50),
    "white": (240, 240, 240),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
END_EVENTS: tuple[str, ...] = ("enters", "leaves", "stops")
BACKGROUND_KINDS: tuple[str, ...] = ("static", "textured")

# Dark, low-saturation solid backgrounds.
_STATIC_BACKGROUNDS: tuple[tuple[int, int, int], ...] = (
    (16, 16, 16),
    (32, 32, 40),
    (40, 34, 30),
    (28, 40, 34),
    (55, 55, 55),
)
# A shape of half-extent s fits in a circle of radius s * this (a square's half-diagonal).
_BOUND_RADIUS = math.sqrt(2.0)
_MAX_ATTEMPTS = 1000


@dataclass(frozen=True)
class SceneConfig:
    """What a clip may look like. Defaults: 112x112, 3 s at 8 fps, one to five objects."""

    width_px: int = 112
    """Frame width; even, for yuv420p."""
    height_px: int = 112
    """Frame height; even, for yuv420p."""
    fps: int = 8
    """Frames per second of the rendered clip."""
    duration_s: float = 3.0
    """Clip length; the clip has `round(fps * duration_s)` frames."""
    min_objects: int = 1
    """Fewest objects in a clip."""
    max_objects: int = 5
    """Most objects in a clip; at most len(COLOURS), since colours are unique within a clip."""
    min_size_px: int = 7
    """Smallest half-extent of a shape (radius of a circle, half side of a square)."""
    max_size_px: int = 10
    """Largest half-extent of a shape."""
    min_travel_px: int = 24
    """Shortest distance an object moves along its main axis."""
    max_drift_ratio: float = 0.25
    """Largest sideways movement as a fraction of the main-axis travel, so direction is clear."""
    min_gap_px: int = 4
    """Least distance between the bounding circles of two objects visible at the same time."""
    min_visible_s: float = 1.0
    """Shortest time an object stays visible, except one entering in the end window."""
    min_tail_s: float = 0.75
    """Shortest time an object that enters in the end window stays visible before the end."""
    event_margin_s: float = 0.5
    """Least time from the start to a later entry, and from an early exit to the end window: one
    sampling period at 2 fps, so sampled frames still show what happened when."""
    min_order_gap_s: float = 0.5
    """Least time between the first two (or last two) entries for an order question to be asked."""
    textured_fraction: float = 0.5
    """Share of clips with a textured background instead of a solid one."""
    p_present_at_start: float = 0.4
    """Chance that an object (not the end-event one) is visible from the first frame."""
    p_present_at_end: float = 0.7
    """Chance that an object (not the end-event one) stays to the last frame."""

    @property
    def num_frames(self) -> int:
        return int(round(self.fps * self.duration_s))

    @property
    def end_window_start(self) -> int:
        """First frame of the end window (the last third of the clip)."""
        return math.ceil(2 * self.num_frames / 3)

    def frames(self, seconds: float) -> int:
        return max(1, int(math.ceil(seconds * self.fps - 1e-9)))

    def validate(self) -> None:
        if self.width_px % 2 or self.height_px % 2:
            raise ValueError(
                f"frame size {self.width_px}x{self.height_px} must be even for yuv420p; "
                "use e.g. 112x112 or 128x96"
            )
        if not 1 <= self.min_objects <= self.max_objects <= len(COLOURS):
            raise ValueError(
                f"need 1 <= min_objects <= max_objects <= {len(COLOURS)} (colours are unique "
                f"in a clip); got {self.min_objects}..{self.max_objects}"
            )
        if not 1 <= self.min_size_px <= self.max_size_px:
            raise ValueError(
                f"need 1 <= min_size_px <= max_size_px, got {self.min_size_px}..{self.max_size_px}"
            )
        span = 2 * (self.max_size_px * _BOUND_RADIUS + 1) + self.min_travel_px
        if span > min(self.width_px, self.height_px):
            raise ValueError(
                f"a {self.min_travel_px} px path for a {self.max_size_px} px object does not fit in "
                f"{self.width_px}x{self.height_px}; lower min_travel_px or max_size_px"
            )
        # Entries and exits before the window are optional (skipped where they don't fit);
        # the end events are not.
        n, e = self.num_frames, self.end_window_start
        if n - e < max(3, self.frames(self.min_tail_s)):
            raise ValueError(
                f"{n} frames ({self.fps} fps x {self.duration_s} s) leave too few in the end window "
                "for an object to enter or leave there; use a longer clip, a higher fps or a "
                "smaller min_tail_s"
            )


@dataclass(frozen=True)
class ObjectSpec:
    """One shape: what it looks like, where it goes, and when it is visible."""

    colour: str
    shape: str
    size_px: int  # half-extent
    start_xy: tuple[float, float]  # centre at move_start_frame, pixels, y down
    end_xy: tuple[float, float]  # centre at move_end_frame
    enter_frame: int  # first visible frame
    exit_frame: int  # one past the last visible frame
    move_start_frame: int
    move_end_frame: int

    def visible(self, frame: int) -> bool:
        return self.enter_frame <= frame < self.exit_frame

    def position(self, frame: int) -> tuple[float, float]:
        """Centre at `frame` (defined for any frame; meaningful where visible)."""
        if frame <= self.move_start_frame:
            return self.start_xy
        if frame >= self.move_end_frame:
            return self.end_xy
        a = (frame - self.move_start_frame) / (self.move_end_frame - self.move_start_frame)
        return (
            self.start_xy[0] + a * (self.end_xy[0] - self.start_xy[0]),
            self.start_xy[1] + a * (self.end_xy[1] - self.start_xy[1]),
        )

    @property
    def direction(self) -> str:
        """Main direction of motion, in screen terms (y grows downwards)."""
        dx = self.end_xy[0] - self.start_xy[0]
        dy = self.end_xy[1] - self.start_xy[1]
        if abs(dx) >= abs(dy):
            return "right" if dx > 0 else "left"
        return "down" if dy > 0 else "up"


@dataclass(frozen=True)
class Scene:
    """A whole clip (or, with `num_frames == 1`, a still image)."""

    seed: int
    config: SceneConfig
    background: str  # one of BACKGROUND_KINDS
    background_rgb: tuple[int, int, int]  # solid colour, or the texture's mean tint
    objects: tuple[ObjectSpec, ...]
    end_event: str | None  # one of END_EVENTS; None for an image
    num_frames: int  # config.num_frames for a clip, 1 for an image

    def visible_objects(self, frame: int) -> list[ObjectSpec]:
        return [o for o in self.objects if o.visible(frame)]

    def by_colour(self, colour: str) -> ObjectSpec:
        for o in self.objects:
            if o.colour == colour:
                return o
        raise KeyError(f"no {colour} object in scene {self.seed}")

    @property
    def is_image(self) -> bool:
        return self.num_frames == 1


def generate_scene(seed: int, config: SceneConfig = SceneConfig()) -> Scene:
    """The clip named by `seed`. Every random draw comes from `default_rng(seed)`, in a fixed order."""
    config.validate()
    rng = np.random.default_rng(seed)
    background, background_rgb = _draw_background(rng, config)
    num_objects = int(rng.integers(config.min_objects, config.max_objects + 1))
    end_event = str(rng.choice(END_EVENTS))
    colours = [list(COLOURS)[i] for i in rng.permutation(len(COLOURS))[:num_objects]]
    for _ in range(_MAX_ATTEMPTS):
        timings = _draw_timings(rng, config, num_objects, end_event)
        objects = _draw_paths(rng, config, colours, timings)
        if objects is not None:
            return Scene(
                seed, config, background, background_rgb, tuple(objects), end_event, config.num_frames
            )
    raise RuntimeError(f"could not place {num_objects} objects without overlap for seed {seed}")


def generate_image_scene(seed: int, config: SceneConfig = SceneConfig()) -> Scene:
    """A still image: the objects of a clip, all visible, not moving. Its own draws from `seed`."""
    config.validate()
    rng = np.random.default_rng(seed)
    background, background_rgb = _draw_background(rng, config)
    num_objects = int(rng.integers(config.min_objects, config.max_objects + 1))
    colours = [list(COLOURS)[i] for i in rng.permutation(len(COLOURS))[:num_objects]]
    for _ in range(_MAX_ATTEMPTS):
        objects = _place_still(rng, config, colours)
        if objects is not None:
            return Scene(seed, config, background, background_rgb, tuple(objects), None, 1)
    raise RuntimeError(f"could not place {num_objects} objects without overlap for seed {seed}")


def _draw_background(rng: np.random.Generator, c: SceneConfig) -> tuple[str, tuple[int, int, int]]:
    kind = "textured" if rng.random() < c.textured_fraction else "static"
    rgb = _STATIC_BACKGROUNDS[int(rng.integers(len(_STATIC_BACKGROUNDS)))]
    return kind, rgb


@dataclass(frozen=True)
class _Timing:
    enter: int
    exit: int
    move_start: int
    move_end: int


def _draw_timings(rng: np.random.Generator, c: SceneConfig, n: int, end_event: str) -> list[_Timing]:
    """Visible spans and motion spans; object 0 carries the end event.

    Frames at 3 s x 8 fps (window = 16, margin = 4, min visible = 8): body entries at 4..8, body
    exits with the last sighting at <= 11, end entries at 16..18, end exits with the last sighting
    at 16..21. Sampled at 2 fps (frames 2, 6, 10, 14, 18, 22) each kind shows differently.
    """
    num_frames, window = c.num_frames, c.end_window_start
    min_visible, margin = c.frames(c.min_visible_s), c.frames(c.event_margin_s)
    last_body_entry = window - min_visible
    last_body_exit = window - margin  # exclusive exit frame: last sighting <= window - margin - 1
    timings = []
    for i in range(n):
        if i == 0 and end_event == "enters":
            enter = int(rng.integers(window, num_frames - c.frames(c.min_tail_s) + 1))
        elif rng.random() < c.p_present_at_start or last_body_entry < margin:
            enter = 0
        else:
            enter = int(rng.integers(margin, last_body_entry + 1))
        if i == 0 and end_event == "leaves":
            exit_ = int(rng.integers(window + 1, num_frames - 1))
        elif i == 0 or rng.random() < c.p_present_at_end or enter + min_visible > last_body_exit:
            exit_ = num_frames  # object 0 stays for "enters" and "stops" (so the stop is seen)
        else:
            exit_ = int(rng.integers(enter + min_visible, last_body_exit + 1))
        if end_event == "stops":
            # Motion ends at or before the window, after a few frames of it to see.
            move_end = min(window, exit_ - 1) - int(rng.integers(0, 3))
            move_end = min(max(move_end, enter + 4), window)
        else:
            move_end = exit_ - 1
        timings.append(_Timing(enter, exit_, enter, max(move_end, enter + 1)))
    return timings


def _draw_paths(
    rng: np.random.Generator, c: SceneConfig, colours: list[str], timings: list[_Timing]
) -> list[ObjectSpec] | None:
    """Straight paths that stay inside the frame and never bring two visible objects too close."""
    placed: list[ObjectSpec] = []
    for colour, t in zip(colours, timings):
        shape = str(rng.choice(SHAPES))
        size = int(rng.integers(c.min_size_px, c.max_size_px + 1))
        direction = str(rng.choice(DIRECTIONS))
        margin = size * _BOUND_RADIUS + 1
        for _ in range(50):
            obj = _draw_path(rng, c, colour, shape, size, direction, margin, t)
            if obj is not None and all(_apart(obj, other, c) for other in placed):
                placed.append(obj)
                break
        else:
            return None
    return placed


def _draw_path(
    rng: np.random.Generator,
    c: SceneConfig,
    colour: str,
    shape: str,
    size: int,
    direction: str,
    margin: float,
    t: _Timing,
) -> ObjectSpec | None:
    horizontal = direction in ("left", "right")
    main_len = c.width_px if horizontal else c.height_px
    side_len = c.height_px if horizontal else c.width_px
    max_travel = main_len - 2 * margin
    travel = float(rng.uniform(c.min_travel_px, max_travel))
    drift = float(rng.uniform(-1.0, 1.0)) * c.max_drift_ratio * travel
    main0 = float(rng.uniform(margin, main_len - margin - travel))
    lo, hi = margin + max(0.0, -drift), side_len - margin - max(0.0, drift)
    if hi <= lo:
        return None
    side0 = float(rng.uniform(lo, hi))
    main1, side1 = main0 + travel, side0 + drift
    if direction in ("left", "up"):
        main0, main1 = main1, main0
    if horizontal:
        start, end = (main0, side0), (main1, side1)
    else:
        start, end = (side0, main0), (side1, main1)
    return ObjectSpec(colour, shape, size, start, end, t.enter, t.exit, t.move_start, t.move_end)


def _apart(a: ObjectSpec, b: ObjectSpec, c: SceneConfig) -> bool:
    need = (a.size_px + b.size_px) * _BOUND_RADIUS + c.min_gap_px
    for f in range(max(a.enter_frame, b.enter_frame), min(a.exit_frame, b.exit_frame)):
        (ax, ay), (bx, by) = a.position(f), b.position(f)
        if math.hypot(ax - bx, ay - by) < need:
            return False
    return True


def _place_still(rng: np.random.Generator, c: SceneConfig, colours: list[str]) -> list[ObjectSpec] | None:
    placed: list[ObjectSpec] = []
    for colour in colours:
        shape = str(rng.choice(SHAPES))
        size = int(rng.integers(c.min_size_px, c.max_size_px + 1))
        margin = size * _BOUND_RADIUS + 1
        for _ in range(50):
            xy = (
                float(rng.uniform(margin, c.width_px - margin)),
                float(rng.uniform(margin, c.height_px - margin)),
            )
            obj = ObjectSpec(colour, shape, size, xy, xy, 0, 1, 0, 1)
            if all(_apart(obj, other, c) for other in placed):
                placed.append(obj)
                break
        else:
            return None
    return placed
