"""The scene generator: one seed, one scene; and the invariants the questions rely on."""

import math

import pytest

from epd.synth.scene import COLOURS, SceneConfig, generate_image_scene, generate_scene


def test_same_seed_same_scene_and_different_seeds_differ():
    assert generate_scene(123) == generate_scene(123)
    assert generate_image_scene(123) == generate_image_scene(123)
    assert generate_scene(123) != generate_scene(124)


@pytest.mark.parametrize("seed", range(0, 300, 1))
def test_scene_invariants(seed):
    c = SceneConfig()
    scene = generate_scene(seed, c)
    n, window = c.num_frames, c.end_window_start
    colours = [o.colour for o in scene.objects]
    assert len(set(colours)) == len(colours) and set(colours) <= set(COLOURS)
    assert c.min_objects <= len(scene.objects) <= c.max_objects
    for o in scene.objects:
        assert 0 <= o.enter_frame < o.exit_frame <= n
        for f in range(o.enter_frame, o.exit_frame):
            x, y = o.position(f)
            r = o.size_px * math.sqrt(2)
            assert r <= x <= c.width_px - r and r <= y <= c.height_px - r
        # Direction is unambiguous: travel on the main axis >= min_travel and >= 4x the drift.
        dx, dy = o.end_xy[0] - o.start_xy[0], o.end_xy[1] - o.start_xy[1]
        main, side = max(abs(dx), abs(dy)), min(abs(dx), abs(dy))
        assert main >= c.min_travel_px - 1e-6 and side <= main * c.max_drift_ratio + 1e-6
    for f in range(n):
        vis = scene.visible_objects(f)
        for i, a in enumerate(vis):
            for b in vis[i + 1 :]:
                (ax, ay), (bx, by) = a.position(f), b.position(f)
                assert math.hypot(ax - bx, ay - by) >= (a.size_px + b.size_px) * math.sqrt(2)
    margin = c.frames(c.event_margin_s)
    for o in scene.objects:  # early events keep clear of the start and of the end window
        assert (
            o.enter_frame == 0
            or margin <= o.enter_frame <= window - c.frames(c.min_visible_s)
            or (o.enter_frame >= window)
        )
        assert o.exit_frame == n or o.exit_frame <= window - margin or o.exit_frame > window
    entered = [o for o in scene.objects if o.enter_frame >= window]
    left = [o for o in scene.objects if window < o.exit_frame < n]
    if scene.end_event == "enters":
        assert len(entered) == 1 and not left
    elif scene.end_event == "leaves":
        assert len(left) == 1 and not entered
    else:
        assert scene.end_event == "stops" and not entered and not left
        assert all(o.move_end_frame <= window for o in scene.objects)
        assert any(o.exit_frame == n for o in scene.objects)


def test_image_scene_is_one_still_frame():
    scene = generate_image_scene(7)
    assert scene.is_image and scene.end_event is None
    assert all(o.start_xy == o.end_xy and o.visible(0) for o in scene.objects)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (SceneConfig(width_px=111), "must be even"),
        (SceneConfig(max_objects=6), "colours are unique"),
        (SceneConfig(width_px=40, height_px=40), "does not fit"),
        (SceneConfig(fps=2, duration_s=2.0), "too few in the end window"),
    ],
)
def test_bad_config_is_refused_with_the_fix(config, match):
    with pytest.raises(ValueError, match=match):
        generate_scene(0, config)
