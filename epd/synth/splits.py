"""Which seeds belong to which split: disjoint ranges, so no clip is ever in two splits.

Each split owns a block of `SEEDS_PER_SPLIT` seeds; videos take the first half of the block and
still images the second, so a split can grow (more clips, more images) without reaching into its
neighbour. The i-th clip of a split is always the same clip, whatever the sizes asked for.
"""

from __future__ import annotations

SPLITS: tuple[str, ...] = ("train", "validation", "test")
SEEDS_PER_SPLIT = 10_000_000
_HALF = SEEDS_PER_SPLIT // 2
SPLIT_SEED_BASE: dict[str, int] = {name: i * SEEDS_PER_SPLIT for i, name in enumerate(SPLITS)}
MEDIA_TYPES: tuple[str, ...] = ("video", "image")


def seed_for(split: str, media_type: str, index: int) -> int:
    """Seed of the `index`-th video or image of `split`."""
    if split not in SPLIT_SEED_BASE:
        raise ValueError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    if media_type not in MEDIA_TYPES:
        raise ValueError(f"unknown media_type {media_type!r}; use 'video' or 'image'")
    if not 0 <= index < _HALF:
        raise ValueError(f"index {index} is outside 0..{_HALF - 1}, the {media_type} seeds of a split")
    return SPLIT_SEED_BASE[split] + (_HALF if media_type == "image" else 0) + index


def split_of(seed: int) -> str:
    """The split that owns `seed`."""
    i = seed // SEEDS_PER_SPLIT
    if seed < 0 or i >= len(SPLITS):
        raise ValueError(f"seed {seed} belongs to no split (0..{len(SPLITS) * SEEDS_PER_SPLIT - 1})")
    return SPLITS[i]


def media_type_of(seed: int) -> str:
    return "image" if seed % SEEDS_PER_SPLIT >= _HALF else "video"
