import pytest
import torch

from epd.token_pruning.config import PruningConfig
from epd.token_pruning.encode_stage import prune_encoded_tokens


def _embeddings(num, dim=8, seed=0):
    return torch.randn(num, dim, generator=torch.Generator().manual_seed(seed))


def test_all_off_is_the_identity():
    emb = _embeddings(2 * 2 * 3 + 4)
    out = prune_encoded_tokens(emb, [[2, 4, 6], [1, 4, 4]], None, PruningConfig())
    torch.testing.assert_close(out.embeddings, emb)
    assert out.token_index.tolist() == list(range(16))
    assert not out.key_mask.any() and out.sizes.sum() == 16


def test_merge_and_key_tokens_across_two_videos_with_temporal_holes():
    # Video A: 2 groups of 2x2 tokens, all identical; cell 7 was dropped by the temporal stage
    # and cell 6 is unlike its neighbours (a key token). Video B: 1 group of 2x2, all different.
    present = torch.tensor([True] * 4 + [True, True, True, False] + [True] * 4)
    emb_a = torch.ones(7, 8)
    emb_a[6] = -1.0
    emb = torch.cat([emb_a, torch.eye(8)[:4]])
    cfg = PruningConfig(spatial_merge=True, spatial_merge_threshold=0.9, key_token_ratio=0.05)
    out = prune_encoded_tokens(emb, [[2, 4, 4], [1, 4, 4]], present, cfg)
    assert out.num_tokens_full == 12 and out.num_tokens_present == 11
    # One key token per video (ceil(5% of its tokens)); B's are all equally distinct: the first.
    assert out.token_index[out.key_mask].tolist() == [6, 8]
    # A: group 0 -> one token of size 4; group 1: cells 4 and 5 merge, key cell 6 stays alone.
    assert out.token_index.tolist() == [0, 4, 6, 8, 9, 10, 11]
    assert out.sizes.tolist() == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    torch.testing.assert_close(out.embeddings[2], -torch.ones(8))


def test_shape_mismatch_names_the_counts():
    with pytest.raises(ValueError, match="5 embeddings and a mask of 12"):
        prune_encoded_tokens(_embeddings(5), [[2, 4, 4], [1, 4, 4]], None, PruningConfig())
