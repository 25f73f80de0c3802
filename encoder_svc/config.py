"""Settings of the Encode service."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.model_runtime.config import ModelConfig
from epd.stages.scheduling import check_scheduling_policy
from epd.stages.server_config import ServerConfig
from epd.video.parallel_decode_config import ParallelDecodeConfig
from epd.video.types import DecodeLimits, SamplingOptions

DEFAULT_PORT = 50051
SMALLEST_PATCH_PIXELS = 14 * 14
"""The smallest vision patch of the families served (Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision, InternVL: 14x14)."""


@dataclass(frozen=True)
class EncoderConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=DEFAULT_PORT))
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    """Caps on uploads and decoding: bytes, duration, pixels, frames."""
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    """Defaults for fields a request leaves unset."""
    max_visual_tokens: int = 16384
    """A request whose sampling would give more visual tokens is refused after its first frame
    group is preprocessed, before any tower call (`--max-visual-tokens`): its estimate is that
    group's tokens per frame, and each later group's check counts the groups done exactly."""
    decode: ParallelDecodeConfig = field(default_factory=ParallelDecodeConfig)
    """The pool of decode threads (one per core by default), shared by all requests."""
    frames_per_group: int = 2
    """Overlap: the vision tower encodes each group of this many frames (even: Qwen encodes
    frames in temporal pairs) as soon as it is decoded, while later frames still decode.
    0 decodes the whole sample first (no overlap). 2 (one temporal pair) leaves the least
    encoding after the last frame decodes; per-group overhead was not measurable on CPU
    (docs/benchmarks.md: 1.11x of max(decode, encode) with 2, 1.25x with 8)."""
    frames_at_model_size: bool = True
    """The PyAV decoder resizes each frame to the size the model's processor would give it as
    soon as it is decoded (`VLMAdapter.frame_resizer`: Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision, InternVL, and
    Qwen3-VL / Qwen3.5 at the whole clip's size for the plan's frame count, where that gives the
    processor's pixels bit for bit), so a request holds its frames at the model's size, not the
    source's: 48 frames of 1080p were 285 MiB, at the tiny Qwen2-VL's 140x84 they are 1.6 MiB.
    The decord backend, and False, keep frames as decoded until `preprocess`."""
    cache: TokenCacheConfig = field(default_factory=TokenCacheConfig)
    """The multimodal token cache: a video seen before is neither decoded nor encoded again."""
    decode_backend: str = "pyav"
    """"pyav" (parallel keyframe-aligned threads, overlapped with encoding) or "decord" (in a
    child process that is killed if it hangs; decodes the whole sample before encoding).
    Both return identical frames for H.264/VP9/MJPEG (tests/unit/video)."""
    max_concurrent_decodes: int = 4
    """Requests whose encode driver runs at once, each on its own thread: the demux index pass,
    waiting for decoded frame groups, preprocessing, cache lookups. Their frame groups go
    through the vision tower together, batched across requests on the one model thread, so a
    slow video delays only itself. Also bounds the requests sharing the decode threads."""
    max_queued_decodes: int = 16
    """Requests that may wait (in `scheduling_policy`'s order, holding their upload) for one of
    `max_concurrent_decodes`; past that the encoder answers RESOURCE_EXHAUSTED at once. 0: never wait."""
    max_tower_jobs_per_request: int = 4
    """Frame groups one request may have queued for the vision tower at once
    (`--max-tower-jobs-per-request`): its driver preprocesses the next groups while the tower
    encodes earlier ones, and a step takes every group waiting (within the patch budget) in one
    call, so groups grow with the load instead of one tower call per temporal pair. 1: the driver
    waits for each group's embeddings before it preprocesses the next."""
    max_tower_patches_per_step: int = 8192
    """Patches one batched vision-tower call may take (`--max-tower-patches-per-step`): each
    step encodes the oldest waiting frame groups, of any requests, while their patches fit (a
    larger group runs alone). Bounds the tower's activation memory per call; 8192 is 8 frame
    groups of 448x448 (Qwen: 1024 patches per temporal pair), 32 of 224x224."""

    merge_decoded_groups: bool = True
    """For a request that starts while no other is decoding and encoding here, a frame group also
    takes the next groups already decoded when the driver asks for it, up to
    `merged_group_frames` and `merged_group_pixels` (`--no-merge-decoded-groups`: every group
    `frames_per_group`). When decoding runs ahead of the tower (a short clip, one keyframe
    interval, an idle machine) there is nothing to overlap, and one preprocess and one tower call
    cost less than one per temporal pair (8 frames of 224x224 at one request in flight: 61-66 ms of
    encode against 72). With other requests encoding, pairs keep their tower steps interleaved
    (merging then cost 3% of requests/s at 16 in flight; docs/benchmarks.md, "Frame groups that
    follow the decoder")."""

    @property
    def merged_group_frames(self) -> int:
        """Most frames of a merged group: what one tower step could take from one request's queue
        anyway (`frames_per_group` x `max_tower_jobs_per_request`); 0 = no merging."""
        if not (self.merge_decoded_groups and self.frames_per_group):
            return 0
        return self.frames_per_group * self.max_tower_jobs_per_request

    @property
    def merged_group_pixels(self) -> int:
        """Most pixels of a merged group: about the patches one tower step takes
        (`max_tower_patches_per_step`), counted with the smallest patch of the families served,
        so that merging never makes a group larger than one step's patches (720p frames are never
        merged: two are more)."""
        return self.max_tower_patches_per_step * SMALLEST_PATCH_PIXELS

    scheduling_policy: str = "fcfs"
    """vLLM's --scheduling-policy: requests wait for a driver, and frame groups for the tower, in
    arrival order (fcfs), or by their request's priority first (priority); `epd.stages.scheduling`."""

    def __post_init__(self) -> None:
        check_scheduling_policy(self.scheduling_policy)
        if self.max_visual_tokens < 1:
            raise ValueError(f"max_visual_tokens must be >= 1, got {self.max_visual_tokens}")
        if self.decode_backend not in ("pyav", "decord"):
            raise ValueError(f"decode_backend must be 'pyav' or 'decord', got {self.decode_backend!r}")
        if self.frames_per_group < 0 or self.frames_per_group % 2:
            raise ValueError(f"frames_per_group must be 0 or even, got {self.frames_per_group}")
        if self.max_concurrent_decodes < 1:
            raise ValueError(
                f"max_concurrent_decodes (--max-concurrent-decodes) must be >= 1, "
                f"got {self.max_concurrent_decodes}"
            )
        if self.max_tower_jobs_per_request < 1:
            raise ValueError(
                f"max_tower_jobs_per_request (--max-tower-jobs-per-request) must be >= 1, "
                f"got {self.max_tower_jobs_per_request}"
            )
        if self.max_tower_patches_per_step < 1:
            raise ValueError(
                f"max_tower_patches_per_step (--max-tower-patches-per-step) must be >= 1, "
                f"got {self.max_tower_patches_per_step}"
            )
        if self.max_queued_decodes < 0:
            raise ValueError(
                f"max_queued_decodes (--max-queued-decodes) must be >= 0, got {self.max_queued_decodes}"
            )
