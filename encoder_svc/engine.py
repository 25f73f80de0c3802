"""Encode: media bytes -> sampled frames -> visual token embeddings. No gRPC here.

A request's life:
  1. The cache key is the media's sha256 plus everything that changes the tokens (sampling,
     model fingerprint, preprocessing bounds). A hit returns the stored embeddings: nothing is
     decoded or encoded.
  2. On a miss, the parallel decoder plans keyframe-aligned intervals and starts its threads;
     frames come back in temporal order, `frames_per_group` at a time.
  3. Each group is preprocessed and run through the vision tower as soon as it arrives, while
     later groups are still decoding (the vision tower attends within one temporal patch only,
     so encoding group by group gives the same tokens as encoding the whole sample).
  4. The concatenated embeddings [num_visual_tokens, hidden] are stored in the cache.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict

import torch

from encoder_svc.config import EncoderConfig
from encoder_svc.pruning import encode_stage_pruning
from encoder_svc.token_cache import TokenCache, make_cache_key
from model_runtime.adapter import VisualMeta, VLMAdapter
from stages.contracts import EncodedMedia, EventSink, MediaInput, StageEvent
from token_pruning import PruningConfig, PruningStats
from transport.errors import NotFound, ResourceExhausted
from video.decord_backend import DecordDecoder
from video.parallel_decoder import ParallelDecoder
from video.types import DecodedVideo, SamplingOptions

log = logging.getLogger(__name__)


class EncoderEngine:
    """Owns the vision tower, the decode pool and the token cache. `encode` runs one request at
    a time (the model thread); the decode pool works for it in parallel."""

    def __init__(self, config: EncoderConfig, adapter: VLMAdapter) -> None:
        self.config = config
        self.adapter = adapter
        self.decoder = ParallelDecoder(config.decode)
        self.cache = TokenCache(config.cache)
        self._decord: DecordDecoder | None = None  # started on first use with decode_backend="decord"

    def cache_key(self, sha256: str, sampling: SamplingOptions, pruning: PruningConfig = PruningConfig()) -> str:
        params = {
            "sampling": asdict(sampling),
            "model": self.adapter.fingerprint,
            "limits_max_source_pixels": self.config.limits.max_source_pixels,
            "decode_backend": self.config.decode_backend,
            "pruning": pruning.encode_cache_key(),
        }
        return make_cache_key(sha256, params)

    def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        # Bytes that were sent are hashed here: a client's hash is trusted only as a reference.
        sha256 = hashlib.sha256(media.data).hexdigest() if media.data is not None else media.sha256
        key = self.cache_key(sha256, sampling, pruning)
        cached = self.cache.get(key)
        if cached is not None:
            on_event(StageEvent("encode", "finished", 0.0, {"cache": "hit"}))
            return _from_cache(cached, sha256)
        if media.data is None:
            raise NotFound(
                f"media {sha256[:12]}... with these sampling options is not cached here; send the file itself"
            )
        out = self._decode_and_encode(media.data, sha256, sampling, on_event, pruning)
        tensors = {"visual_embeds": out.embeds}
        if out.token_index is not None:
            tensors["token_index"] = out.token_index
        if out.key_mask is not None:
            tensors["key_mask"] = out.key_mask
        self.cache.put(
            key,
            tensors,
            {
                "modality": out.meta.modality,
                "grid_thw": list(out.meta.grid_thw),
                "second_per_grid_t": out.meta.second_per_grid_t,
                "frame_timestamps_s": out.frame_timestamps_s,
                "pruning_stages": [[s.stage, s.num_visual_tokens_in, s.num_visual_tokens_out]
                                   for s in out.pruning.stages],
                "num_key_tokens": out.pruning.num_key_tokens,
            },
        )
        return out

    def _frame_groups(self, data: bytes, sha256: str, sampling: SamplingOptions):
        """(stream metadata, iterator of DecodedVideo groups in temporal order)."""
        group_size = self.config.frames_per_group or (1 << 30)
        if self.config.decode_backend == "decord":
            if self._decord is None:
                self._decord = DecordDecoder()
            whole = self._decord.decode(data, sampling, self.config.limits, sha256=sha256)
            return whole, (_slice(whole, i, i + group_size) for i in range(0, whole.num_frames, group_size))
        stream = self.decoder.iter_groups(data, sampling, self.config.limits, group_size, sha256=sha256)

        def groups():
            with stream:
                for g in stream:
                    yield DecodedVideo(g.frames, g.timestamps_s, stream.sampled_fps, stream.duration_s,
                                       stream.source_fps, stream.is_image)

        return stream, groups()

    def _decode_and_encode(
        self, data: bytes, sha256: str, sampling: SamplingOptions, on_event: EventSink,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        t0 = time.perf_counter()
        on_event(StageEvent("decode", "started"))
        meta, groups = self._frame_groups(data, sha256, sampling)
        on_event(StageEvent("decode", "progress", 0.0, {"num_frames": str(meta.num_frames)}))
        # Temporal dropping before the tower needs every group's patches first (the reference
        # of "unchanged" runs across groups), so the tower then runs once on the kept patches.
        sparse = pruning.temporal_drop and pruning.temporal_before_tower and self.adapter.supports_sparse_vision
        embeds: list[torch.Tensor] = []
        pixels: list[torch.Tensor] = []
        grids: list[tuple[int, int, int]] = []
        encode_s = 0.0
        frames_done = 0
        for video in groups:  # decoding of later groups continues while this one encodes
            t_enc = time.perf_counter()
            inputs = self.adapter.preprocess(video)
            self._check_token_budget(inputs.grid_thw, meta.num_frames, video.num_frames)
            if pruning.temporal_drop:
                pixels.append(inputs.pixel_values)
            if not sparse:
                embeds.append(self.adapter.encode(inputs))
            encode_s += time.perf_counter() - t_enc
            grids.append(inputs.grid_thw)
            frames_done += video.num_frames
            on_event(StageEvent("encode", "progress", 0.0, {"frames_done": str(frames_done)}))
        grid = (sum(g[0] for g in grids), grids[0][1], grids[0][2])
        t_enc = time.perf_counter()
        stats = PruningStats()
        token_index = key_mask = None
        if sparse or pruning.spatial_merge or pruning.key_token_ratio > 0 or pruning.temporal_drop:
            visual, token_index, key_mask = encode_stage_pruning(
                self.adapter, torch.cat(embeds) if embeds else None, torch.cat(pixels) if pixels else None,
                grid, pruning, stats,
            )
        else:
            visual = torch.cat(embeds)
        encode_s += time.perf_counter() - t_enc
        total_ms = (time.perf_counter() - t0) * 1e3
        encode_ms = encode_s * 1e3
        decode_ms = total_ms - encode_ms  # time waiting for frames, not hidden behind encoding
        on_event(StageEvent("decode", "finished", decode_ms, {"num_frames": str(meta.num_frames)}))
        on_event(StageEvent("encode", "finished", encode_ms,
                            {"num_visual_tokens": str(visual.shape[0]), "cache": "miss"}))
        return EncodedMedia(
            embeds=visual,
            meta=VisualMeta("image" if meta.is_image else "video", grid, inputs.second_per_grid_t,
                            int(visual.shape[0])),
            num_frames=meta.num_frames,
            frame_timestamps_s=list(meta.timestamps_s),
            decode_ms=decode_ms,
            encode_ms=encode_ms,
            sha256=sha256,
            token_index=token_index,
            key_mask=key_mask,
            pruning=stats,
        )

    def _check_token_budget(self, grid_thw: tuple[int, int, int], num_frames: int, group_frames: int) -> None:
        per_frame = self.adapter.num_visual_tokens(grid_thw) / max(group_frames, 1)
        expected = int(per_frame * num_frames)
        if expected > self.config.max_visual_tokens:
            raise ResourceExhausted(
                f"this video would give about {expected} visual tokens but the encoder allows "
                f"{self.config.max_visual_tokens}; lower max_frames/fps or max_pixels"
            )

    def close(self) -> None:
        self.decoder.close()
        if self._decord is not None:
            self._decord.close()


def _slice(video: DecodedVideo, start: int, end: int) -> DecodedVideo:
    return DecodedVideo(video.frames[start:end], video.timestamps_s[start:end], video.sampled_fps,
                        video.duration_s, video.source_fps, video.is_image)


def _from_cache(cached, sha256: str) -> EncodedMedia:
    meta = cached.metadata
    embeds = cached.tensors["visual_embeds"]
    stats = PruningStats(num_key_tokens=int(meta.get("num_key_tokens", 0)))
    for stage, num_in, num_out in meta.get("pruning_stages", []):
        stats.record(stage, int(num_in), int(num_out))
    grid = tuple(int(x) for x in meta["grid_thw"])
    return EncodedMedia(
        embeds=embeds,
        meta=VisualMeta(meta["modality"], grid, float(meta["second_per_grid_t"]), int(embeds.shape[0])),  # type: ignore[arg-type]
        num_frames=len(meta["frame_timestamps_s"]),
        frame_timestamps_s=list(meta["frame_timestamps_s"]),
        decode_ms=0.0,
        encode_ms=0.0,
        cache_hit=True,
        sha256=sha256,
        token_index=cached.tensors.get("token_index"),
        key_mask=cached.tensors.get("key_mask"),
        pruning=stats,
    )
