"""Pixels and files from a `Scene`: RGB frames drawn with PIL, H.264 MP4 written by PyAV, PNG stills.

Frames are exact functions of the scene (the texture has its own seeded generator), so two renders
of one seed are the same bytes. The MP4 is a real H.264 stream in yuv420p with a fixed keyframe
interval (scene-cut detection off, so keyframes sit exactly every `keyframe_interval` frames, which
the decoder's seek tests rely on) and x264's default B-frames. One encoder thread and a constant
quantiser keep the bytes reproducible (see `EncodeConfig.qp`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from epd.synth.scene import COLOURS, ObjectSpec, Scene


@dataclass(frozen=True)
class EncodeConfig:
    """How a clip is written to MP4."""

    keyframe_interval: int = 8
    """Frames between keyframes (GOP size); 8 = one keyframe a second at 8 fps."""
    qp: int = 22
    """x264 constant quantiser: lower is better quality and larger files. Constant QP rather than
    CRF because CRF's adaptive quantisation and macroblock tree gave different bytes on repeated
    runs of one input (1 run in ~10 on some clips); constant QP turns both off."""
    preset: str = "medium"
    """x264 speed/size preset."""

    def validate(self) -> None:
        if self.keyframe_interval < 1:
            raise ValueError(f"keyframe_interval must be >= 1, got {self.keyframe_interval}")
        if not 0 <= self.qp <= 51:
            raise ValueError(f"qp must be in 0..51, got {self.qp}")


def render_background(scene: Scene) -> np.ndarray:
    """[H, W, 3] uint8. Solid, or smooth grey noise plus faint diagonal stripes around the tint."""
    c = scene.config
    h, w = c.height_px, c.width_px
    tint = np.asarray(scene.background_rgb, dtype=np.float32)
    if scene.background == "static":
        return np.broadcast_to(tint.astype(np.uint8), (h, w, 3)).copy()
    rng = np.random.default_rng([scene.seed, 0x7E97])  # a stream of its own: scene draws are untouched
    coarse = rng.uniform(-1.0, 1.0, size=(6, 6)).astype(np.float32)
    # Bilinear upsampling of a 6x6 grid gives blotches a few objects wide.
    blotch = np.asarray(
        Image.fromarray(coarse, mode="F").resize((w, h), Image.Resampling.BILINEAR), dtype=np.float32
    )
    period = float(rng.uniform(6.0, 14.0))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    stripes = np.sin((xx + yy) * (2 * np.pi / period))
    fine = rng.uniform(-1.0, 1.0, size=(h, w)).astype(np.float32)
    grey = 24.0 * blotch + 8.0 * stripes + 5.0 * fine  # [H, W], stays within about +-37
    out = tint[None, None, :] + 12.0 + grey[:, :, None]  # at most ~105: far from every colour
    return np.clip(out, 0, 255).astype(np.uint8)


def draw_object(draw: ImageDraw.ImageDraw, obj: ObjectSpec, frame: int) -> None:
    x, y = (int(round(v)) for v in obj.position(frame))
    s = obj.size_px
    rgb = COLOURS[obj.colour]
    if obj.shape == "circle":
        draw.ellipse((x - s, y - s, x + s, y + s), fill=rgb)
    elif obj.shape == "square":
        draw.rectangle((x - s, y - s, x + s, y + s), fill=rgb)
    elif obj.shape == "triangle":
        draw.polygon([(x, y - s), (x - s, y + s), (x + s, y + s)], fill=rgb)
    else:
        raise ValueError(f"unknown shape {obj.shape!r}")


def render_frame(scene: Scene, frame: int, background: np.ndarray | None = None) -> np.ndarray:
    """[H, W, 3] uint8: frame `frame` of the scene."""
    bg = render_background(scene) if background is None else background
    img = Image.fromarray(bg.copy())
    draw = ImageDraw.Draw(img)
    for obj in scene.visible_objects(frame):
        draw_object(draw, obj, frame)
    return np.asarray(img, dtype=np.uint8)


def render_frames(scene: Scene) -> np.ndarray:
    """[T, H, W, 3] uint8, T = scene.num_frames."""
    bg = render_background(scene)
    return np.stack([render_frame(scene, f, bg) for f in range(scene.num_frames)])


def encode_mp4(frames: np.ndarray, fps: int, config: EncodeConfig = EncodeConfig()) -> bytes:
    """H.264 MP4 (yuv420p) of `frames` [T, H, W, 3] uint8 at `fps`."""
    import av

    config.validate()
    t, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"frame size {w}x{h} must be even for yuv420p")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        # x264 with several threads does not give the same bytes twice; one thread does.
        stream.codec_context.thread_count = 1
        stream.codec_context.thread_type = "SLICE"
        g = config.keyframe_interval
        stream.options = {
            "qp": str(config.qp),
            "preset": config.preset,
            "x264-params": f"keyint={g}:min-keyint={g}:scenecut=0:threads=1:lookahead-threads=1",
        }
        for i in range(t):
            frame = av.VideoFrame.from_ndarray(frames[i], format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def encode_png(frame: np.ndarray) -> bytes:
    """Lossless PNG of one [H, W, 3] uint8 frame."""
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()
