"""Encode: media bytes -> sampled frames -> visual token embeddings. No gRPC, no asyncio here.

A request's life (`EncoderEngine.encode`, which blocks; the caller runs it on one of the
request-pool threads of `epd.stages.request_pool`, `--max-concurrent-decodes` of them, the
request's *driver*):
  1. The cache key is the media's sha256 plus everything that changes the tokens (sampling,
     model fingerprint, preprocessing bounds). A hit returns the stored embeddings: nothing is
     decoded or encoded.
  2. On a miss, the parallel decoder builds the demux index (on this request's thread) and plans
     keyframe-aligned intervals for its shared decode threads; frames come back in temporal
     order, `frames_per_group` at a time, or, for a request that starts alone, more when the next
     groups are decoded already (`merge_decoded_groups`: decoding ran ahead, so there is nothing
     to overlap).
  3. Each group is preprocessed into patches on the driver, then handed to `run_tower`: the
     stage (`encoder_svc/stage.py`) queues it as a tower job in the encoder's engine core, whose
     steps encode the waiting groups of several requests in one tower call
     (`encoder_svc/scheduler.py`, `encoder_svc/runner.py`), so a request still waiting for its
     frames holds no model time. The driver does not wait for the group: it preprocesses the
     next ones, up to `max_tower_jobs_per_request` queued, and a step takes all that wait, so
     with an idle tower one request's groups merge into fewer, larger calls. Later groups keep
     decoding meanwhile (the vision tower attends within one temporal patch only, so encoding
     group by group, alone or beside other groups, gives the same tokens as encoding the whole
     sample, up to float rounding). Without `run_tower` (tests, benchmarks) each group is
     encoded alone through `run_model`.
  4. Encode-stage pruning (when asked for) is one more model call; the result, an EncodedMedia
     (the concatenated embeddings [num_visual_tokens, hidden], for Qwen3-VL the DeepStack
     features of the same rows and each temporal group's time, and what prefill needs to place
     them), is what the cache stores and what the stage returns. Pruning stages that would lose
     the DeepStack alignment are refused before step 1 (`refuse_unsupported_pruning`).

Cancellation: the caller says `interest.leave()` (`single_flight.Interest`) when its client goes
away. A request waiting on another's encode of the same media stops waiting. The work itself
watches its flight's cancel flag, which is set once nobody wants the result: while other requests
wait on it, it goes on (on this thread) for them after its leader left. The decoder watches that
flag too: the demux pass stops within a few hundred packets or 32 KiB of the file, its workers at
their next frame or read, and a wait for the next group within 50 ms. The driver checks it after
every frame group, before each model call or tower job and every `TOWER_POLL_S` while it waits
for one (a call already queued on the model thread checks it again before it starts; the stage
takes a queued tower job out of the core's queue at once), then closes the frame stream and
raises RequestCancelled. (The decord backend decodes the whole sample in its child process
first; a cancel there takes effect after it.)

A request whose decord child crashes (`DecoderCrashed`: decord crashes on some damaged files, the
same file every time, so a retry would not help) is decoded once more by the PyAV backend, as any
PyAV request is (its plan, limits and cancel flag; the decord child was replaced already), in what
is left of its --max-decode-s: the budget counts from the start of the request's decode, decord's
time included, so a crash late in decord's time does not buy the request a second budget (past
it: the slow decode's error, RESOURCE_EXHAUSTED). The client gets PyAV's answer, tokens or PyAV's
own error (INVALID_ARGUMENT for a corrupt file), `num_decord_fallbacks` counts it
(`epd_encoder_decord_fallbacks_total`), and the crash is one WARNING line in the log (the media's
hash and what follows; no decoder text). `DecoderCrashed` (UNAVAILABLE) is left only for a crash
while the engine closes, when the PyAV backend is closed too; a request cancelled meanwhile stays
cancelled.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import asdict, replace
from typing import Protocol

import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.driver import PendingFeatures, Request, RunModel, RunTower, run_here
from epd.encoder_svc.pruning import encode_stage_pruning
from epd.encoder_svc.single_flight import Interest, SingleFlight, flight_id
from epd.encoder_svc.token_cache import TokenCache, make_cache_key
from epd.model_runtime.adapter import VisionInputs, VisualMeta, VLMAdapter
from epd.stages.contracts import (
    EncodedMedia,
    EventSink,
    MediaInput,
    RequestCancelled,
    StageEvent,
    refuse_unsupported_pruning,
)
from epd.stages.errors import EpdError, InvalidRequest, NotFound, ResourceExhausted
from epd.stages.names import Stage
from epd.stages.request_id import shared_work_context
from epd.token_pruning import PruningConfig
from epd.video.budget import decode_too_long
from epd.video.decord_backend import DecordDecoder
from epd.video.parallel_decoder import CLOSE_WAIT_S as PARALLEL_CLOSE_WAIT_S
from epd.video.parallel_decoder import ParallelDecoder
from epd.video.simple_decoder import check_duration
from epd.video.types import DecodeCancelled, DecodedVideo, DecoderCrashed, MediaError, SamplingOptions

log = logging.getLogger(__name__)

SOURCE_DURATION_FACT = "source_duration_s"
"""What a token-cache entry records of its media besides the tokens: the whole video's duration
(0 for an image), so that a hit is held to --max-duration-s as a miss is (`EncoderEngine._cached`)."""


class FrameSource(Protocol):
    """What the driver needs to know of a sample before its first frame group."""

    @property
    def num_frames(self) -> int: ...

    is_image: bool
    timestamps_s: list[float]
    duration_s: float


class EncoderEngine:
    """Owns the vision tower, the decode pool and the token cache. `encode` may run for several
    requests at once, each on its own thread; every tower call goes through that request's
    `run_tower` (or `run_model`), every other model call through its `run_model`."""

    def __init__(self, config: EncoderConfig, adapter: VLMAdapter) -> None:
        self.config = config
        self.adapter = adapter
        self.decoder = ParallelDecoder(config.decode)
        # The clip's frame count -> [H, W, 3] -> the model's [h, w, 3], on the decode threads;
        # None: frames kept as decoded.
        self._frame_resizer = adapter.frame_resizer if config.frames_at_model_size else None
        self.cache = TokenCache(config.cache)
        self.flights: SingleFlight[EncodedMedia] = SingleFlight()
        """One decode and encode per cache key at a time (`encoder_svc/single_flight.py`)."""
        self._decord: DecordDecoder | None = None  # started on first use with decode_backend="decord"
        self._decord_lock = threading.Lock()
        self.num_decord_fallbacks = 0
        """Requests decoded by the PyAV backend after their decord child crashed, since start
        (under `_decord_lock`)."""
        self._num_encoding = 0  # requests decoding and encoding now (cache misses)
        self._num_encoding_lock = threading.Lock()

    def cache_key(
        self,
        sha256: str,
        sampling: SamplingOptions,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
    ) -> str:
        """The token-cache key, and so the single-flight key: the salt (tenant) is part of both,
        so a by-hash request of another tenant misses exactly like unknown media."""
        params = {
            "sampling": asdict(sampling),
            "model": self.adapter.fingerprint,
            # The same weights compute other numbers in another dtype, on another device type or
            # through another linear kernel: entries of the disk tier (which outlives the process
            # and may be shared) must not cross them.
            "numerics": {
                "dtype": self.config.model.dtype,
                "device": self.config.model.device.partition(":")[0],
                "linear_kernel": self.config.model.linear_kernel,
            },
            "limits_max_source_pixels": self.config.limits.max_source_pixels,
            "decode_backend": self.config.decode_backend,
            "pruning": pruning.encode_cache_key(),
            # What the entry holds besides the embeddings: a DeepStack family's entries carry
            # its features (and the group times), another family's never do.
            "parts": {"deepstack_features": self.adapter.num_deepstack_layers, "group_timestamps": True},
        }
        return make_cache_key(
            sha256, params, family=self.adapter.family or type(self.adapter).__name__, cache_salt=cache_salt
        )

    def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        pruning: PruningConfig = PruningConfig(),
        *,
        run_model: RunModel = run_here,
        run_tower: RunTower | None = None,
        interest: Interest | None = None,
        cache_salt: str = "",
    ) -> EncodedMedia:
        """Blocks until the media is encoded. `interest`: the caller's hold on the request, whose
        `leave()` cancels it (RequestCancelled), unless it leads an encode that others wait on:
        that goes on for them (module docstring). `cache_salt`: the request's tenant, part of the
        cache key (`cache_key`)."""
        # Before any work, cached or not: a stage (of any service) that would lose DeepStack.
        refuse_unsupported_pruning(
            self.adapter.family, self.adapter.supported_pruning, self.adapter.pruning_refusal_reason, pruning
        )
        interest = interest or Interest()
        req = Request(run_model, run_tower, interest.cancel)
        # Bytes that were sent are hashed here: a client's hash is trusted only as a reference.
        sha256 = hashlib.sha256(media.data).hexdigest() if media.data is not None else media.sha256
        if media.data is not None and media.sha256 and media.sha256 != sha256:
            # The gateway routed by the header's hash: a wrong one sends the media to another
            # replica's cache than its later references (by the right hash) go to.
            raise InvalidRequest(
                f"media_sha256 {media.sha256} is not the sha256 of the uploaded bytes, {sha256}; send "
                "hashlib.sha256(data).hexdigest(), or leave media_sha256 empty with the bytes"
            )
        key = self.cache_key(sha256, sampling, pruning, cache_salt)
        if (cached := self._cached(key, sampling)) is not None:
            return self._hit(cached, sha256, on_event)
        # A request already encoding this media with these options: wait for its result.
        flight, shared = self.flights.join(
            key,
            req.check_cancelled,
            lambda: log.info(
                "waiting for the encode of media %s in flight (%s)", sha256[:12], flight_id(key)
            ),
            interest,
        )
        if flight is None:
            assert shared is not None
            return self._hit(shared, sha256, on_event, shared=True)
        out: EncodedMedia | None = None
        try:
            if not interest.lead(flight):
                raise RequestCancelled("cancelled before its encode started")
            # The work stops when nobody wants it any more, not when this request's caller goes:
            # others may be waiting on it by then (`single_flight`).
            req.cancel = flight.cancel
            # A flight that landed since our first look (`in`: a miss is counted once per request).
            if key in self.cache and (cached := self._cached(key, sampling)) is not None:
                out = cached
                return self._hit(cached, sha256, on_event)
            if media.data is None:
                raise NotFound(
                    f"media {sha256[:12]}... with these sampling options is not cached here; send the file itself"
                )
            log.info(
                "decoding and encoding media %s (%d bytes): not cached; as %s, for this request and any "
                "that come to wait on it",
                sha256[:12],
                len(media.data),
                flight.id,
            )
            # In the flight's own context, not this request's: the work outlives the request while
            # others wait on it, so its log lines name the flight and no client's deadline ends it
            # (`single_flight`); priority and tower job ids follow `Flight.runs_for` as before.
            work = shared_work_context(flight.id)
            out = work.run(
                self._decode_and_encode, req, media.data, sha256, sampling, on_event, pruning, cache_salt
            )
            self.cache.put(key, out, {SOURCE_DURATION_FACT: req.source_duration_s})
            return out
        finally:
            flight.land(out)

    def _cached(self, key: str, sampling: SamplingOptions) -> EncodedMedia | None:
        """The cached media under `key` once it passes this encoder's limits now, with the
        message a miss would give (MediaLimitError, ResourceExhausted): a disk-tier entry may have
        been made by an encoder started with higher --max-visual-tokens or --max-duration-s, and a
        hit by hash must not serve what sending the bytes would be refused. An entry that does not
        record its video's duration (written before entries did) is a miss: decoding checks it."""
        entry = self.cache.get_entry(key)
        if entry is None:
            return None
        cached, facts = entry
        sampling.validate(self.config.limits.max_frames)
        if SOURCE_DURATION_FACT not in facts:
            return None
        check_duration(float(facts[SOURCE_DURATION_FACT]), self.config.limits)
        self._check_expected_tokens(self.adapter.num_visual_tokens(cached.meta.grid_thw))  # before pruning
        return cached

    @staticmethod
    def _hit(cached: EncodedMedia, sha256: str, on_event: EventSink, shared: bool = False) -> EncodedMedia:
        """A request answered without decoding or encoding: from the token cache, or `shared` by
        the request that was encoding the same media at the same time."""
        on_event(
            StageEvent(
                Stage.ENCODE,
                "finished",
                0.0,
                {"cache": "hit", **({"shared_with": "in-flight request"} if shared else {})},
            )
        )
        # Stored as it was made; this request decoded and encoded nothing.
        return replace(cached, cache_hit=True, decode_ms=0.0, encode_ms=0.0, sha256=sha256)

    def open_frames(
        self,
        data: bytes,
        sha256: str,
        sampling: SamplingOptions,
        cancel: threading.Event | None = None,
        merge: bool = False,
        cache_salt: str = "",
    ) -> tuple[FrameSource, Generator[DecodedVideo, None, None]]:
        """(stream metadata, generator of DecodedVideo groups in temporal order). Closing the
        generator early cancels the decode work still pending; setting `cancel` stops the demux
        pass and the decoding, and a wait for the next group, with DecodeCancelled. `merge`: groups
        already decoded merge (`EncoderConfig.merge_decoded_groups`). `cache_salt`: the request's
        tenant, as in the token cache's key: the decoders' keyframe-index caches are per tenant
        too, since a hit there shortens the decode time the client is told."""
        group_size = self.config.frames_per_group or (1 << 30)
        # --max-decode-s bounds the request's decode, whichever backends it takes: from here.
        decode_started_s = time.monotonic()
        if (decord := self._decord_for(data, sha256, sampling, cache_salt)) is not None:
            try:
                whole = decord.decode(
                    data,
                    sampling,
                    self.config.limits,
                    sha256=sha256,
                    cache_salt=cache_salt,
                    started_s=decode_started_s,
                )
            except DecoderCrashed:
                if not self._falls_back_to_pyav(sha256, cancel, decode_started_s):
                    raise
            else:
                step = self._merged_step(whole, group_size) if merge else group_size  # every frame is decoded
                return whole, (_slice(whole, i, i + step) for i in range(0, whole.num_frames, step))
        stream = self.decoder.iter_groups(
            data,
            sampling,
            self.config.limits,
            group_size,
            sha256=sha256,
            cancel=cancel,
            merge_up_to=self.config.merged_group_frames if merge else 0,
            merge_up_to_pixels=self.config.merged_group_pixels,
            cache_salt=cache_salt,
            frame_resizer=self._frame_resizer,
            decode_started_s=decode_started_s,
        )

        def groups():
            with stream:
                for g in stream:
                    yield DecodedVideo(
                        g.frames,
                        g.timestamps_s,
                        stream.sampled_fps,
                        stream.duration_s,
                        stream.source_fps,
                        stream.is_image,
                    )

        return stream, groups()

    def _decord_for(
        self, data: bytes, sha256: str, sampling: SamplingOptions, cache_salt: str
    ) -> DecordDecoder | None:
        """The decord backend when it decodes this request (`decode_backend="decord"`), else None
        (PyAV). decord reads HEVC from the first frame (it cannot seek in it): a request that PyAV's
        seeking decodes with fewer frames is PyAV's (`DecordDecoder.hands_over`)."""
        if self.config.decode_backend != "decord":
            return None
        with self._decord_lock:
            if self._decord is None:
                self._decord = DecordDecoder(index_cache=self.decoder.index_cache)
        hand_over = self._decord.hands_over(
            data, sampling, self.config.limits, sha256=sha256, cache_salt=cache_salt
        )
        return None if hand_over else self._decord

    def _falls_back_to_pyav(
        self, sha256: str, cancel: threading.Event | None, decode_started_s: float
    ) -> bool:
        """After the decord child crashed on this request: whether the PyAV backend decodes it
        instead, in what is left of the request's --max-decode-s (counted from `decode_started_s`,
        so a crash late in decord's time does not buy it a second budget). False: the engine is
        closing, PyAV's pool with it. The same file crashes decord every time (a retry would not
        help), and PyAV decodes most such files or refuses them as corrupt. A request cancelled
        meanwhile stays cancelled; one whose budget is spent gets the slow decode's error.
        Each crash is one WARNING line, this one (the backend's own is INFO): what happened and
        what follows, no decoder text."""
        crashed = f"the decord child crashed on media {sha256[:12]}"
        if cancel is not None and cancel.is_set():
            log.warning("%s; the request was cancelled meanwhile: not decoded again", crashed)
            raise DecodeCancelled("cancelled while the decord backend decoded")
        if self.decoder.closed:
            log.warning("%s while the encoder closes: not decoded again", crashed)
            return False
        limits = self.config.limits
        left_s = decode_started_s + limits.max_decode_s - time.monotonic()
        if left_s <= 0:
            log.warning(
                "%s with its --max-decode-s of %g s spent: not decoded again", crashed, limits.max_decode_s
            )
            raise decode_too_long(limits)
        with self._decord_lock:
            self.num_decord_fallbacks += 1
        log.warning(
            "%s; decoding it with the PyAV backend instead, in the %.1f s left of its --max-decode-s",
            crashed,
            left_s,
        )
        return True

    def _merged_step(self, whole: DecodedVideo, group_size: int) -> int:
        """Frames per group of a video decoded whole: groups merged within the config's bounds."""
        if not self.config.merged_group_frames or whole.num_frames == 0:
            return group_size
        frame_pixels = max(1, whole.frames.shape[1] * whole.frames.shape[2])  # frames: [n, height, width, 3]
        fit = min(self.config.merged_group_frames, self.config.merged_group_pixels // frame_pixels)
        return max(group_size, fit // group_size * group_size)

    def _decode_and_encode(
        self,
        req: Request,
        data: bytes,
        sha256: str,
        sampling: SamplingOptions,
        on_event: EventSink,
        pruning: PruningConfig = PruningConfig(),
        cache_salt: str = "",
    ) -> EncodedMedia:
        t0 = time.perf_counter()
        on_event(StageEvent(Stage.VIDEO_DECODE, "started"))
        # Groups merge only for a request that starts alone: with others encoding, pairs let their
        # tower steps interleave and batch (docs/benchmarks.md, "Frame groups that follow the decoder").
        with self._num_encoding_lock:
            alone = self._num_encoding == 0
            self._num_encoding += 1
        try:
            return self._encode_frames(
                req, data, sha256, sampling, on_event, pruning, t0, merge=alone, cache_salt=cache_salt
            )
        except DecodeCancelled as exc:
            raise RequestCancelled(f"{exc}, after {req.num_groups_done} frame groups") from None
        finally:
            with self._num_encoding_lock:
                self._num_encoding -= 1

    def _encode_frames(
        self,
        req: Request,
        data: bytes,
        sha256: str,
        sampling: SamplingOptions,
        on_event: EventSink,
        pruning: PruningConfig,
        t0: float,
        merge: bool = False,
        cache_salt: str = "",
    ) -> EncodedMedia:
        meta, groups = self.open_frames(data, sha256, sampling, req.cancel, merge, cache_salt)
        req.source_duration_s = float(meta.duration_s)
        on_event(StageEvent(Stage.VIDEO_DECODE, "progress", 0.0, {"num_frames": str(meta.num_frames)}))
        # Temporal dropping before the tower needs every group's patches first (the reference
        # of "unchanged" runs across groups), so the tower then runs once on the kept patches.
        sparse = (
            pruning.temporal_drop and pruning.temporal_before_tower and self.adapter.supports_sparse_vision
        )
        embeds: list[torch.Tensor] = []  # per group: [group_tokens, hidden]
        deepstack: list[list[torch.Tensor]] = []  # per group: one [group_tokens, hidden] per DeepStack layer
        times: list[float] = []  # per temporal patch group (Qwen3-VL's prompt times)
        pixels: list[torch.Tensor] = []  # per group: [group_patches, patch_dim]
        grids: list[tuple[int, int, int]] = []
        frames_done = 0
        # Groups queued for the tower, oldest first: at most `max_tower_jobs_per_request`, so the
        # driver preprocesses the next group while the tower encodes earlier ones, and a step
        # encodes all that wait in one call.
        pending: deque[PendingFeatures] = deque()

        def collect_oldest() -> None:
            group = req.wait(pending.popleft())
            embeds.append(group.embeds)
            deepstack.append(list(group.deepstack or []))

        # closing(): leaving early (cancel, error) closes the stream, which stops its decoding.
        with contextlib.closing(groups):
            try:
                req.check_cancelled()  # cancelled during the index pass: wait for no frame at all
                for video in groups:  # decoding of later groups continues while earlier ones encode
                    inputs = self._preprocess(req, video, meta.num_frames, frames_done, grids)
                    if pruning.temporal_drop:
                        pixels.append(inputs.pixel_values)
                    if not sparse:  # sparse: the tower waits for every group's patches (pruning below)
                        pending.append(req.submit_tower(self.adapter, inputs))
                        while len(pending) > self.config.max_tower_jobs_per_request - 1:
                            collect_oldest()
                    grids.append(inputs.grid_thw)
                    times.extend(inputs.group_timestamps_s)
                    frames_done += video.num_frames
                    req.num_groups_done += 1
                    on_event(StageEvent(Stage.ENCODE, "progress", 0.0, {"frames_done": str(frames_done)}))
                    req.check_cancelled()  # before waiting for the next group
                while pending:
                    collect_oldest()
            finally:
                for job in pending:  # left early: nobody wants them encoded
                    job.cancel()
        grid = (sum(g[0] for g in grids), grids[0][1], grids[0][2])
        token_index = key_mask = None
        # [N, hidden] per DeepStack layer, all groups (none for families without DeepStack)
        features = [torch.cat(layer) for layer in zip(*deepstack, strict=True)] if deepstack else []
        if sparse or pruning.spatial_merge or pruning.key_token_ratio > 0 or pruning.temporal_drop:
            visual, token_index, key_mask = req.model(
                encode_stage_pruning,
                self.adapter,
                torch.cat(embeds) if embeds else None,
                torch.cat(pixels) if pixels else None,
                grid,
                pruning,
                req.stats,
            )
            # The kept tokens are rows of the full list (spatial merging, which mixes rows, is
            # refused for DeepStack families): each feature keeps the same rows.
            features = [f[token_index] for f in features]
        else:
            visual = torch.cat(embeds)
        total_ms = (time.perf_counter() - t0) * 1e3
        encode_ms = req.model_s * 1e3
        decode_ms = total_ms - encode_ms  # time waiting for frames, not hidden behind encoding
        on_event(StageEvent(Stage.VIDEO_DECODE, "finished", decode_ms, {"num_frames": str(meta.num_frames)}))
        on_event(
            StageEvent(
                Stage.ENCODE,
                "finished",
                encode_ms,
                {"num_visual_tokens": str(visual.shape[0]), "cache": "miss"},
            )
        )
        return EncodedMedia(
            embeds=visual,
            meta=VisualMeta(
                "image" if meta.is_image else "video",
                grid,
                inputs.second_per_grid_t,
                int(visual.shape[0]),
                tuple(times),
            ),
            num_frames=meta.num_frames,
            frame_timestamps_s=list(meta.timestamps_s),
            decode_ms=decode_ms,
            encode_ms=encode_ms,
            sha256=sha256,
            token_index=token_index,
            key_mask=key_mask,
            pruning=req.stats,
            deepstack=features,
        )

    def _preprocess(
        self,
        req: Request,
        video: DecodedVideo,
        num_frames: int,
        frames_done: int,
        grids_done: list[tuple[int, int, int]],
    ) -> VisionInputs:
        """On the driver: one group's patches [group_patches, patch_dim], sized as the processor
        sizes the whole clip of `num_frames` frames (the plan's count, known before decoding
        ends), checked against the visual-token budget before any tower work. The `frames_done`
        frames before this group gave `grids_done`."""
        t0 = time.perf_counter()
        try:
            inputs = self.adapter.preprocess(video, clip_num_frames=num_frames)
        except ValueError as exc:
            if isinstance(exc, (EpdError, MediaError)):
                raise
            raise _refused_frames(video, exc) from None
        finally:
            req.model_s += time.perf_counter() - t0
        tokens_done = sum(self.adapter.num_visual_tokens(g) for g in grids_done)
        frames_left = num_frames - frames_done - video.num_frames
        self._check_token_budget(inputs.grid_thw, video.num_frames, tokens_done, frames_left)
        return inputs

    def _check_token_budget(
        self, grid_thw: tuple[int, int, int], group_frames: int, tokens_done: int, frames_left: int
    ) -> None:
        """The clip's visual tokens: those of the groups so far, this one's, and the frames after
        it at this group's tokens per frame (exact at the last group, where a 1-frame tail that
        fills a whole temporal patch would overstate the rate)."""
        group_tokens = self.adapter.num_visual_tokens(grid_thw)
        self._check_expected_tokens(
            tokens_done + group_tokens + int(group_tokens / max(group_frames, 1) * max(frames_left, 0))
        )

    def _check_expected_tokens(self, expected: int) -> None:
        """ResourceExhausted when a request would give more than --max-visual-tokens (before pruning)."""
        if expected > self.config.max_visual_tokens:
            raise ResourceExhausted(
                f"this video would give about {expected} visual tokens but the encoder allows "
                f"{self.config.max_visual_tokens} (encoder flag --max-visual-tokens); lower max_frames/fps "
                "or max_pixels"
            )

    def close(self, wait_s: float | None = None) -> None:
        """Stop the decode workers and the decord child, waiting for them for at most `wait_s` in
        all (0: stop them, wait for nothing) and never longer than `parallel_decoder.CLOSE_WAIT_S`
        (a worker stops at its next frame: one that takes longer is stuck)."""
        wait_s = PARALLEL_CLOSE_WAIT_S if wait_s is None else min(wait_s, PARALLEL_CLOSE_WAIT_S)
        ends_s = time.monotonic() + wait_s
        self.decoder.close(wait_s)
        if self._decord is not None:
            self._decord.close(max(0.0, ends_s - time.monotonic()))


MAX_PROCESSOR_ASPECT_RATIO = 200
"""The longest side over the shortest that Qwen's and GLM's processors take (their `smart_resize`
raises ValueError past it)."""


def _refused_frames(video: DecodedVideo, exc: ValueError) -> InvalidRequest:
    """The client's error for frames the model's processor refused (a ValueError from
    `VLMAdapter.preprocess`: they are the media's, a 1000x4 image, not the server's); its text
    goes to the log only."""
    height, width = video.frames.shape[1:3]  # frames: [n, height, width, 3]
    log.info("the model's processor refused frames of %dx%d: %s", width, height, exc)
    if max(height, width) > MAX_PROCESSOR_ASPECT_RATIO * max(min(height, width), 1):
        why = f"an aspect ratio over the {MAX_PROCESSOR_ASPECT_RATIO}:1 this model's processor takes"
        change = f"crop or pad it to at most {MAX_PROCESSOR_ASPECT_RATIO}:1"
    else:
        why, change = "a size this model's processor does not take", "send it at another size"
    return InvalidRequest(
        f"the {'image' if video.is_image else 'video'} is {width}x{height}, {why}; {change}"
    )


def _slice(video: DecodedVideo, start: int, end: int) -> DecodedVideo:
    return DecodedVideo(
        video.frames[start:end],
        video.timestamps_s[start:end],
        video.sampled_fps,
        video.duration_s,
        video.source_fps,
        video.is_image,
    )
