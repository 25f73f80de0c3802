import numpy as np
import pytest
import torch

from epd.token_pruning.temporal import sparse_vision_inputs, temporal_redundancy_mask, vision_patch_positions
from tests.unit.token_pruning.pruning_media import decode_video, encode_video, process_video, textured_frame


def _video(tmp_path, frames):
    path = tmp_path / "clip.mp4"
    encode_video(path, frames)
    return process_video(decode_video(path))


def test_static_video_drops_most_tokens(tmp_path, rng):
    pixels, grid = _video(tmp_path, np.stack([textured_frame(rng)] * 16))
    result = temporal_redundancy_mask(pixels, grid, threshold=0.05)
    t = int(grid[0, 0])
    per_frame = result.num_tokens_in // t
    assert t == 8
    # Only the first frame group survives: everything later is a copy of it.
    assert result.keep_tokens[:per_frame].all()
    assert result.num_tokens_out == per_frame
    assert result.keep_patches.sum() == 4 * per_frame


def test_every_frame_new_drops_nothing(tmp_path, rng):
    pixels, grid = _video(tmp_path, np.stack([textured_frame(rng) for _ in range(16)]))
    result = temporal_redundancy_mask(pixels, grid, threshold=0.05)
    assert result.num_tokens_out == result.num_tokens_in


def test_moving_object_keeps_only_changed_cells(tmp_path, rng):
    background = textured_frame(rng)
    frames = []
    for i in range(8):
        frame = background.copy()
        frame[:28, 28 * (i // 2) : 28 * (i // 2) + 28] = 255  # a white square moving along row 0
        frames.append(frame)
    pixels, grid = _video(tmp_path, np.stack(frames))
    result = temporal_redundancy_mask(pixels, grid, threshold=0.05)
    keep = result.keep_tokens.view(4, 4, 4)  # t, rows, cols of merged tokens
    assert keep[0].all()
    # Later groups keep only the cells the square left or entered (merged row 0).
    assert not keep[1:, 1:].any()
    for g in range(1, 4):
        assert keep[g, 0, g] and keep[g, 0, g - 1]


def test_slow_drift_is_caught_against_last_kept_reference():
    # Each group brightens by 0.02 (below threshold) but the drift adds up.
    base = torch.zeros(1, 4, 1176)
    pixels = torch.cat([base + 0.02 * i for i in range(6)]).reshape(-1, 1176)
    result = temporal_redundancy_mask(pixels, [[6, 2, 2]], threshold=0.05)
    assert result.keep_tokens.tolist() == [True, False, False, True, False, False]


def test_threshold_zero_keeps_all_and_shape_mismatch_raises():
    pixels = torch.zeros(32, 1176)
    assert temporal_redundancy_mask(pixels, [[2, 4, 4]], threshold=0.0).keep_tokens.all()
    with pytest.raises(ValueError, match="describes 48 patches"):
        temporal_redundancy_mask(pixels, [[3, 4, 4]], threshold=0.1)


def test_patch_positions_match_transformers():
    from transformers.vision_utils import get_vision_position_ids

    grid = torch.tensor([[2, 4, 6], [1, 2, 2]])
    assert torch.equal(vision_patch_positions(grid), get_vision_position_ids(grid, 2))


def _tiny_tower():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(depth=2, embed_dim=32, num_heads=2, hidden_size=48, mlp_ratio=2)
    return Qwen2VisionTransformerPretrainedModel._from_config(config).eval()


@torch.no_grad()
def test_sparse_tower_inputs_run_the_real_vision_tower():
    tower = _tiny_tower()
    grid = torch.tensor([[3, 4, 4]])
    pixels = torch.randn(48, 1176)
    full = tower(pixels, grid_thw=grid).pooler_output  # [12, 48]

    everything = sparse_vision_inputs(pixels, grid, torch.ones(12, dtype=torch.bool))
    out = tower(
        everything.pixel_values,
        grid_thw=grid,
        position_ids=everything.position_ids,
        cu_seqlens=everything.cu_seqlens,
    ).pooler_output
    torch.testing.assert_close(out, full)

    # Dropping the middle group entirely: attention is per group, so the others are exact.
    keep = torch.tensor([True] * 4 + [False] * 4 + [True] * 4)
    sparse = sparse_vision_inputs(pixels, grid, keep)
    assert sparse.cu_seqlens.tolist() == [0, 16, 32]
    out = tower(
        sparse.pixel_values, grid_thw=grid, position_ids=sparse.position_ids, cu_seqlens=sparse.cu_seqlens
    ).pooler_output
    torch.testing.assert_close(out, full[keep])

    # Dropping single tokens: one output per kept token, close to but not equal to full grids.
    keep = torch.tensor([True] * 4 + [True, False, False, True] + [False, True, True, True])
    sparse = sparse_vision_inputs(pixels, grid, keep)
    assert sparse.cu_seqlens.tolist() == [0, 16, 24, 36]
    out = tower(
        sparse.pixel_values, grid_thw=grid, position_ids=sparse.position_ids, cu_seqlens=sparse.cu_seqlens
    ).pooler_output
    assert out.shape == (9, 48)
    torch.testing.assert_close(out[:4], full[:4])
