"""Read objects back from decoded pixels, without looking at the scene that made them.

This is the check that a clip shows what its answers claim: decode the MP4 (or PNG), label every
pixel with the nearest object colour (or background when no colour is near), split each colour's
pixels into connected blobs, and describe each blob by area, centroid and two shape cues: the share
of its pixels above the bounding box's middle row (a triangle pointing up has ~1/4, circles and
squares ~1/2) and how full the four corner quarters of its bounding box are (a square's are full, a
circle's nearly empty). `track_objects` turns that into one track per colour: the frames where it
is visible, where it is, and its shape.

Only the palette (`scene.COLOURS`) and the shape families are shared with the generator; positions,
timings and shapes are all measured.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from epd.synth.scene import COLOURS

COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
_PALETTE = np.asarray([COLOURS[c] for c in COLOUR_NAMES], dtype=np.float32)  # [K, 3]
# A decoded pixel belongs to a colour when it is this close (RGB distance) to it. Backgrounds are
# >= 110 away from every colour; interiors of decoded shapes land within ~30.
MAX_COLOUR_DISTANCE = 60.0
# Blobs smaller than this are codec ringing, not objects (the smallest object covers ~90 px).
MIN_BLOB_AREA_PX = 30
# Measured on 2,900 decoded blobs (sizes 7-10 px, CRF 20): triangles' top share 0.23-0.33, others'
# 0.45-0.55; circles' corner fill 0.06-0.38, squares' 0.69-1.0. The cuts sit in the middle of the gaps.
_TOP_SHARE_TRIANGLE_MAX = 0.39
_CORNER_FILL_CIRCLE_MAX = 0.55


@dataclass(frozen=True)
class Blob:
    colour: str
    area_px: int
    centroid_xy: tuple[float, float]
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive
    top_share: float  # share of pixels above the bbox's middle row (of those not on it)
    corner_fill: float  # mean fill of the four corner quarter-boxes of the bbox

    @property
    def shape(self) -> str:
        if self.top_share < _TOP_SHARE_TRIANGLE_MAX:
            return "triangle"
        return "circle" if self.corner_fill < _CORNER_FILL_CIRCLE_MAX else "square"

    @classmethod
    def from_pixels(cls, colour: str, yx: np.ndarray) -> Blob:
        """The blob made of pixels `yx` [N, 2] (row, column)."""
        ys, xs = yx[:, 0], yx[:, 1]
        x0, y0, x1, y1 = int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())
        mid = (y0 + y1) / 2
        above, below = int((ys < mid).sum()), int((ys > mid).sum())
        box = np.zeros((y1 - y0 + 1, x1 - x0 + 1), dtype=bool)  # [h, w]
        box[ys - y0, xs - x0] = True
        qh, qw = max(1, box.shape[0] // 4), max(1, box.shape[1] // 4)
        corners = (box[:qh, :qw], box[:qh, -qw:], box[-qh:, :qw], box[-qh:, -qw:])
        return cls(
            colour=colour,
            area_px=len(yx),
            centroid_xy=(float(xs.mean()), float(ys.mean())),
            bbox=(x0, y0, x1, y1),
            top_share=above / max(1, above + below),
            corner_fill=float(np.mean([c.mean() for c in corners])),
        )


@dataclass
class Track:
    """One colour across the clip."""

    colour: str
    frames: list[int] = field(default_factory=list)  # frames where a blob of this colour is seen
    blobs: list[Blob] = field(default_factory=list)  # the largest blob of the colour, per frame

    @property
    def first_frame(self) -> int:
        return self.frames[0]

    @property
    def last_frame(self) -> int:
        return self.frames[-1]

    @property
    def shape(self) -> str:
        """The shape most frames agree on."""
        shapes = [b.shape for b in self.blobs]
        return max(sorted(set(shapes)), key=shapes.count)

    def direction(self) -> str:
        """Main direction from the first to the last visible centroid; y grows downwards."""
        (x0, y0), (x1, y1) = self.blobs[0].centroid_xy, self.blobs[-1].centroid_xy
        dx, dy = x1 - x0, y1 - y0
        if abs(dx) >= abs(dy):
            return "right" if dx > 0 else "left"
        return "down" if dy > 0 else "up"

    def max_step_px(self, from_frame: int) -> float:
        """Largest centroid move between consecutive visible frames at or after `from_frame`."""
        pts = [b.centroid_xy for f, b in zip(self.frames, self.blobs) if f >= from_frame]
        steps = [np.hypot(b[0] - a[0], b[1] - a[1]) for a, b in zip(pts, pts[1:])]
        return float(max(steps, default=0.0))


def decode_media(source: str | Path | bytes) -> np.ndarray:
    """All frames of an MP4 or PNG, [T, H, W, 3] uint8, in presentation order (PNG: T = 1)."""
    from epd.video.media_open import open_image, open_video, sniff_container

    data = Path(source).read_bytes() if isinstance(source, (str, Path)) else source
    if sniff_container(data).is_image:
        with open_image(data) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)[None]
    with open_video(data) as container:
        stream = container.streams.video[0]
        decoded = [(int(f.pts or 0), f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
    decoded.sort(key=lambda x: x[0])  # decoders emit display order already; sorting makes it certain
    return np.stack([f for _, f in decoded])


def label_pixels(frame: np.ndarray) -> np.ndarray:
    """[H, W] int8: index into COLOUR_NAMES of the nearest colour, or -1 for background."""
    dist = np.linalg.norm(
        frame[:, :, None, :].astype(np.float32) - _PALETTE[None, None], axis=-1
    )  # [H, W, K]
    labels = dist.argmin(axis=-1).astype(np.int8)
    labels[dist.min(axis=-1) > MAX_COLOUR_DISTANCE] = -1
    return labels


def connected_components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean [H, W] mask, each as an [N, 2] array of (y, x)."""
    seen = np.zeros_like(mask, dtype=bool)
    h, w = mask.shape
    comps = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, pixels = deque([(y0, x0)]), []
        while queue:
            y, x = queue.popleft()
            pixels.append((y, x))
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        comps.append(np.asarray(pixels))
    return comps


def find_blobs(frame: np.ndarray) -> list[Blob]:
    """Every object-sized blob of one colour in `frame` [H, W, 3]."""
    labels = label_pixels(frame)
    blobs = []
    for k, colour in enumerate(COLOUR_NAMES):
        for comp in connected_components(labels == k):
            if len(comp) >= MIN_BLOB_AREA_PX:
                blobs.append(Blob.from_pixels(colour, comp))
    return blobs


def count_blobs(frame: np.ndarray) -> int:
    """Objects in one frame: connected blobs of any object colour, colour ignored."""
    comps = connected_components(label_pixels(frame) >= 0)
    return sum(len(c) >= MIN_BLOB_AREA_PX for c in comps)


def track_objects(frames: np.ndarray) -> dict[str, Track]:
    """One track per colour seen anywhere in `frames` [T, H, W, 3], keyed by colour."""
    tracks: dict[str, Track] = {}
    for t, frame in enumerate(frames):
        largest: dict[str, Blob] = {}
        for blob in find_blobs(frame):
            if blob.colour not in largest or blob.area_px > largest[blob.colour].area_px:
                largest[blob.colour] = blob
        for colour, blob in largest.items():
            track = tracks.setdefault(colour, Track(colour))
            track.frames.append(t)
            track.blobs.append(blob)
    return tracks
