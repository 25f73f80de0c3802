"""Budgets: how many tokens each stage keeps."""

import pytest


def test_staged_keep_counts_shrink_geometrically_to_the_final_budget():
    from epd.token_pruning.budget import staged_keep_counts

    assert staged_keep_counts(100, 25, 1) == [25]
    assert staged_keep_counts(100, 25, 2) == [50, 25]
    assert staged_keep_counts(64, 8, 3) == [32, 16, 8]
    assert staged_keep_counts(10, 10, 3) == [10, 10, 10]
    assert staged_keep_counts(0, 0, 2) == [0, 0]
    counts = staged_keep_counts(37, 5, 4)
    assert counts[-1] == 5 and all(a >= b for a, b in zip(counts, counts[1:])) and counts[0] <= 37
    with pytest.raises(ValueError):
        staged_keep_counts(10, 11, 2)
