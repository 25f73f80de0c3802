"""Turning a ratio / count / bytes budget into an exact number of kept tokens.

Every stage calls these, so "keep 25%" means the same number everywhere: ceil(ratio * n), with
the product rounded to 6 decimals first so that 0.3 * 10 keeps 3, not 4.
"""

from __future__ import annotations

import math


def keep_count_from_ratio(num_tokens: int, keep_ratio: float) -> int:
    """ceil(keep_ratio * num_tokens), clamped to [0, num_tokens]."""
    if not 0.0 <= keep_ratio <= 1.0:
        raise ValueError(f"keep ratio must be in [0, 1], got {keep_ratio}")
    return min(num_tokens, max(0, math.ceil(round(keep_ratio * num_tokens, 6))))


def resolve_keep_count(num_tokens: int, keep_ratio: float = 1.0, keep_count: int | None = None) -> int:
    """The exact number of tokens a stage keeps: `keep_count` if given (clamped to n), else ratio."""
    if keep_count is not None:
        if keep_count < 0:
            raise ValueError(f"keep count must be >= 0, got {keep_count}")
        return min(num_tokens, keep_count)
    return keep_count_from_ratio(num_tokens, keep_ratio)


def staged_keep_counts(num_tokens: int, final_count: int, num_stages: int) -> list[int]:
    """Survivors after each of `num_stages` drops that end at `final_count`, shrinking by the same
    factor at every stage (geometric): 100 tokens, 25 kept, 2 stages -> [50, 25]. Non-increasing,
    the last is exactly `final_count`."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= final_count <= num_tokens:
        raise ValueError(f"final count {final_count} must be in [0, {num_tokens}]")
    if num_tokens == 0:
        return [0] * num_stages
    ratio = final_count / num_tokens
    counts = [
        max(final_count, math.ceil(round(num_tokens * ratio ** ((i + 1) / num_stages), 6)))
        for i in range(num_stages - 1)
    ]
    return [*counts, final_count]


def kv_bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one sequence position costs in a KV cache: keys and values of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def visual_keep_count_from_bytes(
    budget_bytes: int,
    num_text_positions: int,
    num_visual_positions: int,
    bytes_per_position: int,
) -> int:
    """Largest number of visual positions such that text + visual fit in `budget_bytes`.

    Text positions are never evicted (text-prior), so a budget below the text's own size is an
    error that names the smallest budget that works.
    """
    text_bytes = num_text_positions * bytes_per_position
    if budget_bytes < text_bytes:
        raise ValueError(
            f"kv_budget_bytes={budget_bytes} is below the {text_bytes} bytes the "
            f"{num_text_positions} text positions need; raise it to at least {text_bytes}"
        )
    return min(num_visual_positions, (budget_bytes - text_bytes) // bytes_per_position)
