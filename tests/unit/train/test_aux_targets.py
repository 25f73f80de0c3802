"""Dense training targets (epd/train/aux_targets.py) agree with the scene and with the pixels."""

from __future__ import annotations

import numpy as np
import torch

from epd.synth.render import render_frames
from epd.synth.scene import COLOURS, DIRECTIONS, SHAPES, ObjectSpec, Scene, SceneConfig, generate_scene
from epd.train.aux_targets import IGNORE, NUM_COLOURS, AuxHead, TokenTargets, token_targets

COLOURS_LIST = list(COLOURS)


def _scene(objects, num_frames=24) -> Scene:
    return Scene(
        seed=1,
        config=SceneConfig(),
        background="static",
        background_rgb=(16, 16, 16),
        objects=tuple(objects),
        end_event="stops",
        num_frames=num_frames,
    )


def test_one_moving_square_lights_its_cells_and_its_group():
    # A red square of half-size 8 moving right from x=20 to x=90 at y=20 over frames 0..23.
    sq = ObjectSpec("red", "square", 8, (20.0, 20.0), (90.0, 20.0), 0, 24, 0, 23)
    t = token_targets(_scene([sq]), [2, 6, 10, 14, 18, 22], (3, 8, 8))
    red = COLOURS_LIST.index("red")
    assert t.cell_present.shape == (48, NUM_COLOURS)
    # Only red is ever present, and only in the top row of 4x4 cells (y 12..28 spans rows 0 and 1
    # of 28-px cells: 12..27 in row 0, 28 in row 1 is a single pixel line, under MIN_COVER).
    assert t.cell_present[:, [c for c in range(NUM_COLOURS) if c != red]].sum() == 0
    lit = t.cell_present[:, red].reshape(3, 4, 4)
    assert lit[:, 1:, :].sum() == 0 and (lit[:, 0, :].sum(dim=1) >= 1).all()
    # The square moves right over the clip: its cells move right group by group.
    cols = [torch.nonzero(lit[g, 0]).float().mean().item() for g in range(3)]
    assert cols[0] < cols[1] < cols[2]
    assert set(t.cell_shape[t.cell_present[:, red] > 0, red].tolist()) == {SHAPES.index("square")}
    assert set(t.cell_dir[t.cell_present[:, red] > 0, red].tolist()) == {DIRECTIONS.index("right")}
    # Group targets: every token of every group knows red is on both frames, a square, moving right.
    assert (t.group_present[:, red] == 1).all() and (t.group_present[:, NUM_COLOURS + red] == 1).all()
    assert (t.group_shape[:, red] == SHAPES.index("square")).all()
    assert (t.group_shape[:, [c for c in range(NUM_COLOURS) if c != red]] == IGNORE).all()


def test_entry_and_standstill_are_labelled_per_frame():
    # Blue circle enters at frame 8 and never moves: absent from group 0's first frame (2) and
    # second frame (6); present in groups 1 and 2; no direction label anywhere (not moving).
    c = ObjectSpec("blue", "circle", 8, (60.0, 60.0), (60.0, 60.0), 8, 24, 8, 9)
    t = token_targets(_scene([c]), [2, 6, 10, 14, 18, 22], (3, 8, 8))
    blue = COLOURS_LIST.index("blue")
    per_group = t.group_present.reshape(3, 16, 2 * NUM_COLOURS)[:, 0]
    assert per_group[:, blue].tolist() == [0.0, 1.0, 1.0]
    assert per_group[:, NUM_COLOURS + blue].tolist() == [0.0, 1.0, 1.0]
    assert (t.cell_dir == IGNORE).all() and (t.group_dir == IGNORE).all()
    assert t.cell_present[:16].sum() == 0 and t.cell_present[16:, blue].sum() > 0


def test_targets_match_the_rendered_pixels_on_generated_scenes():
    """Where a cell says colour c is present, that colour's pixels are in the cell on one of the
    pair's frames; where it says absent, (almost) none are."""
    for seed in range(5):
        scene = generate_scene(seed)
        frames = render_frames(scene)  # [24, 112, 112, 3]
        sampled = [2, 6, 10, 14, 18, 22]
        t = token_targets(scene, sampled, (3, 8, 8))
        for g in range(3):
            pair = frames[[sampled[2 * g], sampled[2 * g + 1]]].astype(int)  # [2, H, W, 3]
            for name in {o.colour for o in scene.objects}:
                c = COLOURS_LIST.index(name)
                hit = (np.abs(pair - np.array(COLOURS[name])).sum(-1) < 30).any(0)  # [H, W]
                cover = hit.reshape(4, 28, 4, 28).mean(axis=(1, 3)).reshape(-1)  # [16]
                said = t.cell_present[g * 16 : (g + 1) * 16, c].numpy()
                assert (cover[said > 0] > 0.02).all(), (seed, g, name)
                assert (cover[said == 0] < 0.06).all(), (seed, g, name)


def test_head_loss_is_finite_and_learns_on_a_fixed_batch():
    torch.manual_seed(0)
    sq = ObjectSpec("green", "triangle", 9, (30.0, 80.0), (30.0, 20.0), 0, 24, 0, 23)
    targets = TokenTargets.cat([token_targets(_scene([sq]), [2, 6, 10, 14, 18, 22], (3, 8, 8))] * 2)
    visual = torch.randn(96, 32)
    head = AuxHead(32)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    first = float(head.loss(visual, targets).detach())
    for _ in range(100):
        opt.zero_grad()
        loss = head.loss(visual, targets)
        loss.backward()
        opt.step()
    assert np.isfinite(first) and float(loss.detach()) < 0.3 * first
