"""The media's flags: how frames are sampled from a video (`SamplingOptions`: the encoder's, the
gateway's defaults for requests, `epd ask`'s request), the limits every decode of untrusted media
obeys (`DecodeLimits`), the upload limit, and the encoder's own (`EncoderConfig`)."""

from __future__ import annotations

import argparse


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    from epd.video.types import SamplingOptions

    g = p.add_argument_group("frame sampling")
    # --fps unset is None, so that `epd ask` sends a rate only when one is asked for (a request
    # with fps and num_frames is refused); the services' default rate is SamplingOptions.fps.
    g.add_argument(
        "--fps",
        type=float,
        default=None,
        help=f"frames sampled per second of video (default {SamplingOptions.fps:g})",
    )
    g.add_argument("--max-frames", type=int, default=32)
    g.add_argument(
        "--num-frames",
        type=int,
        default=0,
        help="exactly N frames, uniformly (a service's default for requests that name neither; "
        "instead of --fps, here as in epd ask)",
    )
    g.add_argument(
        "--max-pixels", type=int, default=0, help="downscale frames above H*W pixels (0 = model default)"
    )


def add_decode_limit_flags(g) -> None:
    """The limits every decode of untrusted media obeys (`DecodeLimits`): the encoder's, and the
    gateway's for its web demo's thumbnails (`epd serve` gives both the same values)."""
    from epd.video.types import DecodeLimits

    g.add_argument(
        "--max-source-pixels",
        type=int,
        default=DecodeLimits.max_source_pixels,
        help="largest video frame or image, width x height, checked on every decoded frame",
    )
    g.add_argument(
        "--max-decoded-pixels",
        type=int,
        default=DecodeLimits.max_decoded_pixels,
        help="pixels one request may decode, every frame counted (at least 256x256 each)",
    )
    g.add_argument(
        "--max-duration-s",
        type=float,
        default=DecodeLimits.max_duration_s,
        help="longest video accepted, in seconds of its own timeline (clips are cut first)",
    )
    g.add_argument(
        "--max-demux-s",
        type=float,
        default=DecodeLimits.max_demux_s,
        help="seconds the demux (index) pass of one video may take",
    )
    g.add_argument(
        "--max-decode-s",
        type=float,
        default=DecodeLimits.max_decode_s,
        help="seconds the frame decoding of one request may take (all its decode workers)",
    )


def add_max_upload_bytes_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """One flag for the encoder's and the gateway's upload limits (`epd serve` passes it to both)."""
    from epd.gateway.config import GatewayConfig

    p.add_argument(
        "--max-upload-bytes",
        type=int,
        default=GatewayConfig.max_upload_bytes,
        help="largest media file, in bytes: the gateway's gRPC uploads, data URLs and fetched media, "
        "and the encoder's uploads",
    )


def add_encoder_flags(p: argparse.ArgumentParser) -> None:
    from epd.video.parallel_decode_config import ParallelDecodeConfig

    g = p.add_argument_group("encoder")
    add_max_upload_bytes_flag(g)
    g.add_argument(
        "--max-visual-tokens",
        type=int,
        default=16384,
        help="visual tokens one request may produce; checked after its first frame group",
    )
    add_decode_limit_flags(g)
    g.add_argument(
        "--index-cache-bytes",
        type=int,
        default=ParallelDecodeConfig.index_cache_bytes,
        help="memory of the cached keyframe indexes (LRU)",
    )
    g.add_argument("--decode-workers", type=int, default=0, help="video decode threads (0 = one per core)")
    g.add_argument(
        "--frames-per-group",
        type=int,
        default=2,
        help="encode frames in groups of N while later frames decode (even; 0 = no overlap)",
    )
    g.add_argument(
        "--cache-memory-bytes",
        type=int,
        default=2 << 30,
        help="multimodal token cache in memory (LRU); 0 disables it",
    )
    g.add_argument("--cache-dir", default="", help="directory of the on-disk token cache tier (default: off)")
    g.add_argument(
        "--decode-backend",
        choices=["pyav", "decord"],
        default="pyav",
        help="video decoder: parallel PyAV threads (default) or decord in a child process",
    )
    g.add_argument(
        "--max-concurrent-decodes",
        type=int,
        default=4,
        help="requests decoded at once, each on its own driver thread (their frame groups "
        "share batched vision-tower calls on the one model thread)",
    )
    g.add_argument(
        "--max-tower-jobs-per-request",
        type=int,
        default=4,
        help="frame groups one request may have queued for the vision tower: the next are "
        "preprocessed while the tower encodes, and one step encodes all waiting (1 = wait each)",
    )
    g.add_argument(
        "--merge-decoded-groups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="for a request that starts while no other is encoding, a frame group also takes the "
        "next groups already decoded (up to frames-per-group x max-tower-jobs-per-request "
        "frames): one tower call when decoding runs ahead",
    )
    g.add_argument(
        "--max-tower-patches-per-step",
        type=int,
        default=8192,
        help="patches one batched vision-tower call may take (frame groups of several "
        "requests; a larger group runs alone)",
    )
    g.add_argument(
        "--max-queued-decodes",
        type=int,
        default=16,
        help="requests that may wait for a decode slot; beyond, RESOURCE_EXHAUSTED at once",
    )
