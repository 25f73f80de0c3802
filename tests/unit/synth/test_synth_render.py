"""Rendering and encoding: reproducible bytes, a real H.264 MP4 with the keyframes asked for."""

import io

import av
import numpy as np
import pytest

from epd.synth.render import EncodeConfig, encode_mp4, encode_png, render_frames
from epd.synth.scene import SceneConfig, generate_scene


def test_same_seed_renders_the_same_bytes():
    a, b = render_frames(generate_scene(5)), render_frames(generate_scene(5))
    assert a.dtype == np.uint8 and a.shape == (24, 112, 112, 3)
    assert a.tobytes() == b.tobytes()
    assert encode_mp4(a, 8) == encode_mp4(b, 8)
    assert not np.array_equal(a, render_frames(generate_scene(6)))


def test_textured_background_has_texture_and_static_does_not():
    seeds = {generate_scene(s).background: s for s in range(20)}
    textured = render_frames(generate_scene(seeds["textured"]))[0]
    static = render_frames(generate_scene(seeds["static"]))
    assert textured.reshape(-1, 3).std(axis=0).max() > 5
    # Static background: the most common colour covers most of the frame.
    flat = static[0].reshape(-1, 3)
    _, counts = np.unique(flat, axis=0, return_counts=True)
    assert counts.max() > 0.8 * len(flat)


def test_mp4_is_h264_yuv420p_with_keyframes_every_interval():
    config = SceneConfig(width_px=128, height_px=96, fps=10, duration_s=2.0, min_tail_s=0.5)
    frames = render_frames(generate_scene(11, config))
    data = encode_mp4(frames, config.fps, EncodeConfig(keyframe_interval=5))
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264"
        assert stream.codec_context.pix_fmt == "yuv420p"
        assert (stream.codec_context.width, stream.codec_context.height) == (128, 96)
        assert float(stream.average_rate) == 10
        decoded = sorted(container.decode(stream), key=lambda f: f.pts)
    assert len(decoded) == 20
    assert [i for i, f in enumerate(decoded) if f.key_frame] == [0, 5, 10, 15]
    err = np.abs(np.stack([f.to_ndarray(format="rgb24") for f in decoded]).astype(int) - frames)
    assert err.mean() < 3  # lossy, but close to what was drawn


def test_png_is_lossless():
    from PIL import Image

    frame = render_frames(generate_scene(3))[10]
    back = np.asarray(Image.open(io.BytesIO(encode_png(frame))).convert("RGB"))
    assert np.array_equal(back, frame)


def test_bad_encode_settings_are_refused():
    frames = np.zeros((2, 16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="keyframe_interval must be >= 1"):
        encode_mp4(frames, 8, EncodeConfig(keyframe_interval=0))
    with pytest.raises(ValueError, match="must be even"):
        encode_mp4(np.zeros((2, 15, 16, 3), np.uint8), 8)
