"""Dense auxiliary supervision for the vision tower: what each visual token should know.

Why: trained on the answers alone, the tiny model sat on the answer prior for tens of thousands
of questions (epd/train/README.md): one answer word per question is a weak, late signal for a vision
tower that must first learn to see colour, shape and motion at 1-2 patches per object. The
synthetic scenes know exactly what is where on every frame, so during training each merged visual
token (the vision tower's output, one per 2x2 patches of one temporal pair of frames) also predicts,
through a linear head that is thrown away after training:

- cell: which colours cover its 28x28-pixel cell in either frame of its pair, and for each, the
  object's shape and (when it moves between the two frames) its direction;
- group: for the whole pair of frames (every token of the group carries it), which colours are
  visible on the first and on the second frame, their shapes and directions.

Qwen2-VL's vision tower attends only within one temporal pair, so these are things a token can
know from its own pair. The language model still has to combine pairs (count, order, entries,
exits, end events) from the answers alone. The served model is the plain Qwen2VL class: the head
is not saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from epd.synth.render import draw_object
from epd.synth.scene import COLOURS, DIRECTIONS, SHAPES, Scene

NUM_COLOURS = len(COLOURS)
COLOUR_NAMES = tuple(COLOURS)
MIN_COVER = 0.04
"""Share of a cell's pixels an object must cover to count as in the cell (~31 of 28x28 px)."""
MIN_MOVE_PX = 2.0
"""Least centre displacement between the two frames of a pair for a direction label."""
IGNORE = -100

# Output layout of the head: (name, number of logits).
_LAYOUT: tuple[tuple[str, int], ...] = (
    ("cell_present", NUM_COLOURS),
    ("cell_shape", NUM_COLOURS * len(SHAPES)),
    ("cell_dir", NUM_COLOURS * len(DIRECTIONS)),
    ("group_present", 2 * NUM_COLOURS),
    ("group_shape", NUM_COLOURS * len(SHAPES)),
    ("group_dir", NUM_COLOURS * len(DIRECTIONS)),
)
NUM_OUTPUTS = sum(n for _, n in _LAYOUT)


@dataclass
class TokenTargets:
    """Targets for the N merged tokens of one media file, in the vision tower's output order
    (temporal pair, then row, then column of 2x2-patch cells)."""

    cell_present: torch.Tensor  # [N, C] float 0/1
    cell_shape: torch.Tensor  # [N, C] long shape index or IGNORE
    cell_dir: torch.Tensor  # [N, C] long direction index or IGNORE
    group_present: torch.Tensor  # [N, 2C] float 0/1: first frame's colours, then second's
    group_shape: torch.Tensor  # [N, C] long or IGNORE
    group_dir: torch.Tensor  # [N, C] long or IGNORE

    @staticmethod
    def cat(items: list[TokenTargets]) -> TokenTargets:
        return TokenTargets(*(torch.cat([getattr(t, f) for t in items]) for f in _FIELDS))


_FIELDS = ("cell_present", "cell_shape", "cell_dir", "group_present", "group_shape", "group_dir")


def _object_mask(scene: Scene, obj, frame: int) -> np.ndarray:
    """[H, W] float32 1 where `obj` is drawn on `frame` (0 everywhere if it is not visible)."""
    c = scene.config
    img = Image.new("RGB", (c.width_px, c.height_px), (0, 0, 0))
    if obj.visible(frame):
        draw_object(ImageDraw.Draw(img), obj, frame)  # every object colour is non-black
    return (np.asarray(img).max(axis=-1) > 0).astype(np.float32)


def _cell_cover(mask: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[rows, cols] share of each cell covered by the mask (box-filtered)."""
    img = Image.fromarray(mask, mode="F").resize((cols, rows), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.float32)


def token_targets(
    scene: Scene, frame_indices: list[int], grid_thw: tuple[int, int, int], merge: int = 2
) -> TokenTargets:
    """Targets for one media file.

    frame_indices: the scene frames the serving path sampled, in order (a still: [0]); padded to
    the processor's temporal pairs by repeating the last, as the processor pads. grid_thw: the
    processor's patch grid; the merged tokens are [t, h / merge, w / merge].
    """
    t, h, w = grid_thw
    rows, cols = h // merge, w // merge
    frames = list(frame_indices)
    while len(frames) < 2 * t:
        frames.append(frames[-1])
    per_group = rows * cols
    n = t * per_group
    out = TokenTargets(
        cell_present=torch.zeros(n, NUM_COLOURS),
        cell_shape=torch.full((n, NUM_COLOURS), IGNORE, dtype=torch.long),
        cell_dir=torch.full((n, NUM_COLOURS), IGNORE, dtype=torch.long),
        group_present=torch.zeros(n, 2 * NUM_COLOURS),
        group_shape=torch.full((n, NUM_COLOURS), IGNORE, dtype=torch.long),
        group_dir=torch.full((n, NUM_COLOURS), IGNORE, dtype=torch.long),
    )
    for g in range(t):
        f0, f1 = frames[2 * g], frames[2 * g + 1]
        sl = slice(g * per_group, (g + 1) * per_group)
        for obj in scene.objects:
            c = COLOUR_NAMES.index(obj.colour)
            seen0, seen1 = obj.visible(f0), obj.visible(f1)
            if not (seen0 or seen1):
                continue
            cover = np.maximum(
                _cell_cover(_object_mask(scene, obj, f0), rows, cols),
                _cell_cover(_object_mask(scene, obj, f1), rows, cols),
            ).reshape(-1)  # [rows * cols]
            (x0, y0), (x1, y1) = obj.position(f0), obj.position(f1)
            moving = seen0 and seen1 and float(np.hypot(x1 - x0, y1 - y0)) >= MIN_MOVE_PX
            shape = SHAPES.index(obj.shape)
            direction = DIRECTIONS.index(obj.direction) if moving else IGNORE
            in_cell = torch.from_numpy(cover >= MIN_COVER)  # [rows * cols]
            cells = torch.arange(sl.start, sl.stop)[in_cell]
            out.cell_present[cells, c] = 1.0
            out.cell_shape[cells, c] = shape
            out.cell_dir[cells, c] = direction
            out.group_present[sl, c] = float(seen0)
            out.group_present[sl, NUM_COLOURS + c] = float(seen1)
            out.group_shape[sl, c] = shape
            out.group_dir[sl, c] = direction
    return out


class AuxHead(torch.nn.Module):
    """Linear read-out of every target from a merged visual token ([N, hidden] -> [N, outputs])."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, NUM_OUTPUTS)

    def loss(self, visual: torch.Tensor, targets: TokenTargets) -> torch.Tensor:
        """Mean of the six parts' losses. visual: [N, hidden], the vision tower's pooler output."""
        logits = self.proj(visual)  # [N, NUM_OUTPUTS]
        parts = dict(zip((name for name, _ in _LAYOUT), logits.split([k for _, k in _LAYOUT], dim=-1)))
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        ce = torch.nn.functional.cross_entropy
        n = visual.shape[0]
        losses = [
            bce(parts["cell_present"], targets.cell_present),
            bce(parts["group_present"], targets.group_present),
        ]
        for name, classes in (
            ("cell_shape", len(SHAPES)),
            ("cell_dir", len(DIRECTIONS)),
            ("group_shape", len(SHAPES)),
            ("group_dir", len(DIRECTIONS)),
        ):
            target = getattr(targets, name).reshape(-1)  # [N * C]
            if bool((target != IGNORE).any()):
                losses.append(ce(parts[name].reshape(n * NUM_COLOURS, classes), target, ignore_index=IGNORE))
        return torch.stack(losses).mean()
