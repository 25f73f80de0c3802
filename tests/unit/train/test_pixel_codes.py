"""uint8 storage of prepared patches (epd/train/pixel_codes.py) gives back the processor's float32
patches bit for bit, and refuses patches it cannot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epd.train.pixel_codes import PixelCodec


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))


def test_video_and_image_patches_round_trip_exactly(processor):
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, size=(6, 112, 112, 3), dtype=np.uint8)
    video = processor.video_processor(
        videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt"
    )["pixel_values_videos"]
    image = processor.image_processor(images=[frames[0]], return_tensors="pt")["pixel_values"]
    for proc, patches in ((processor.video_processor, video), (processor.image_processor, image)):
        codec = PixelCodec.of(proc)
        codes = codec.encode(patches)
        assert codes.dtype == torch.uint8 and codes.shape == patches.shape
        assert torch.equal(codec.decode(codes), patches)
        # The codes are the frames' own byte values (no resize at 112x112): the same multiset.
        assert (
            sorted(codes[:, : codes.shape[1] // 3].flatten().tolist())[:5]
            == sorted(frames[..., 0].flatten().tolist())[:5]
        )


def test_patches_the_processor_did_not_make_are_refused(processor):
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 256, size=(2, 56, 56, 3), dtype=np.uint8)
    patches = processor.video_processor(
        videos=[frames], do_sample_frames=False, cap_pixels_per_frame=False, return_tensors="pt"
    )["pixel_values_videos"]
    codec = PixelCodec.of(processor.video_processor)
    with pytest.raises(ValueError, match="keep them as float32"):
        codec.encode(patches + 1e-3)
    other = PixelCodec((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255)
    with pytest.raises(ValueError, match="not the processor's normalised uint8 pixels"):
        other.encode(patches)
