"""Real videos through the real Qwen2-VL processor, for the token_pruning tests."""

from __future__ import annotations

import av
import numpy as np
import torch

from tests.media import X264_SAME_BYTES


def encode_video(path, frames: np.ndarray, fps: int = 8) -> None:
    """Write [T, H, W, 3] uint8 frames as an H.264 MP4 with PyAV."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "x264-params": X264_SAME_BYTES}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decode_video(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def process_video(frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos [P, 1176], video_grid_thw [1, 3]) from Qwen2-VL's video processor."""
    from transformers import Qwen2VLVideoProcessor

    processor = Qwen2VLVideoProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112})
    out = processor(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], do_sample_frames=False, return_tensors="pt"
    )
    return out["pixel_values_videos"], out["video_grid_thw"]


def textured_frame(rng: np.random.Generator, size: int = 112) -> np.ndarray:
    """A blocky random texture (compressible, but every 14-pixel patch differs)."""
    blocks = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
    return np.kron(blocks, np.ones((8, 8, 1), dtype=np.uint8))
