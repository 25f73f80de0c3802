"""Settings of the parallel decoder's thread pool (`epd.video.parallel_decoder`), apart from the
pool itself so that the `epd` command line and the encoder's config read them without numpy or
FFmpeg."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelDecodeConfig:
    """Settings of one ParallelDecoder (one pool shared by all requests)."""

    num_workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    """Decode threads; each decodes one share of a request at a time. Default: one per core."""
    request_timeout_s: float = 300.0
    """A request not finished after this long fails with MediaError and its workers are replaced."""
    stall_timeout_s: float = 30.0
    """A worker that decodes no frame for this long is treated as hung."""
    seek_cost_frames: float = 3.0
    """A seek (flush + keyframe) costs about this many decoded frames; neighbouring intervals
    closer than this are decoded through, and each interval's cost includes one seek."""
    index_cache_entries: int = 256
    """Keyframe indexes kept in memory, by content hash."""
    index_cache_bytes: int = 64 << 20
    """Memory the cached keyframe indexes may hold (16 bytes per frame each), in bytes
    (--index-cache-bytes); least recently used ones are evicted first."""
    skip_nonref_frames: bool = True
    """H.264/HEVC: frames that no other frame references and that are not targets are not decoded
    (FFmpeg's `skip_frame=NONREF`, switched per packet). Lossless: a skipped frame cannot change any
    other frame. With x264's default B-frames about 45% of frames are skipped, which is most of the
    gain where keyframes are far apart and most of a GOP must be decoded anyway."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.request_timeout_s <= 0 or self.stall_timeout_s <= 0:
            raise ValueError("request_timeout_s and stall_timeout_s must be > 0")
        if self.index_cache_bytes < 0:
            raise ValueError(f"index_cache_bytes must be >= 0, got {self.index_cache_bytes}")
