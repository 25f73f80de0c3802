"""The multimodal token cache and decode/encode overlap, through the real encoder engine and a
real stack: a video seen before is neither decoded nor encoded again, by bytes or by hash, and
the disk tier survives a restart."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from epd.client import EpdClient, EpdError
from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.stages.contracts import MediaInput
from epd.stages.errors import NotFound
from epd.video.types import SamplingOptions
from tests.stack import Stack

QUESTION = "what colour is the square?"


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")


def _encode(engine, data, sampling, sha=""):
    events = []
    out = engine.encode(MediaInput(data, sha), sampling, events.append)
    return out, events


def test_overlap_gives_the_same_tokens_as_whole_sample(adapter, media_files, closing):
    data = media_files["mp4"].read_bytes()
    sampling = SamplingOptions(num_frames=16)
    whole, _ = _encode(closing(EncoderEngine(EncoderConfig(frames_per_group=0), adapter)), data, sampling)
    grouped, events = _encode(
        closing(EncoderEngine(EncoderConfig(frames_per_group=4, merge_decoded_groups=False), adapter)),
        data,
        sampling,
    )
    assert grouped.meta == whole.meta
    torch.testing.assert_close(grouped.embeds, whole.embeds, rtol=1e-5, atol=1e-6)
    progress = [e for e in events if e.stage == "encode" and e.state == "progress"]
    assert [e.details["frames_done"] for e in progress] == ["4", "8", "12", "16"]


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "pairs"])
def test_groups_already_decoded_merge_into_fewer_groups(adapter, tmp_path, merge, closing):
    """One keyframe interval: every frame is decoded once the first pair is, so the encoder (by
    default) merges the groups already decoded, up to frames_per_group x max_tower_jobs_per_request
    frames (2 x 4): 16 frames in two groups instead of eight pairs, with the embeddings of the
    whole sample."""
    from tests.media import make_video

    data = make_video(tmp_path / "one_keyframe.mp4", size=(112, 84), seconds=2.0, gop=1000).read_bytes()
    sampling = SamplingOptions(num_frames=16)
    whole, _ = _encode(closing(EncoderEngine(EncoderConfig(frames_per_group=0), adapter)), data, sampling)
    config = EncoderConfig(frames_per_group=2, max_tower_jobs_per_request=4, merge_decoded_groups=merge)
    got, events = _encode(closing(EncoderEngine(config, adapter)), data, sampling)
    assert got.meta == whole.meta
    torch.testing.assert_close(got.embeds, whole.embeds, rtol=1e-5, atol=1e-6)
    progress = [e.details["frames_done"] for e in events if e.stage == "encode" and e.state == "progress"]
    assert progress == (["8", "16"] if merge else [str(n) for n in range(2, 17, 2)])


def test_groups_merge_only_for_a_request_that_starts_alone(adapter, tmp_path, closing):
    """A request that starts while another is decoding and encoding on the same engine keeps its
    pairs, so that the two requests' tower steps interleave and batch. The first request is held
    inside its frame stream (after its first group) while the second runs."""
    from tests.media import make_video

    data = make_video(tmp_path / "one_keyframe.mp4", size=(112, 84), seconds=2.0, gop=1000).read_bytes()
    other = make_video(
        tmp_path / "other.mp4", size=(112, 84), seconds=2.0, gop=1000, pattern="noise"
    ).read_bytes()
    sampling = SamplingOptions(num_frames=16)
    engine = closing(EncoderEngine(EncoderConfig(cache=TokenCacheConfig(memory_budget_bytes=0)), adapter))
    first_group_out, let_go = threading.Event(), threading.Event()
    open_frames = engine.open_frames

    def held_open_frames(data_, sha256, sampling_, cancel=None, merge=False, cache_salt=""):
        meta, groups = open_frames(data_, sha256, sampling_, cancel, merge, cache_salt)
        if data_ is not other:
            return meta, groups

        def held():
            for i, group in enumerate(groups):
                yield group
                if i == 0:
                    first_group_out.set()
                    assert let_go.wait(60), "the test never let the first request go on"

        return meta, held()

    engine.open_frames = held_open_frames  # type: ignore[method-assign]
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_encode, engine, other, sampling)
        assert first_group_out.wait(60), "the first request's first group never came"
        _, events = _encode(engine, data, sampling)  # while the first is still encoding
        let_go.set()
        _, first_events = first.result(60)
    progress = [e.details["frames_done"] for e in events if e.stage == "encode" and e.state == "progress"]
    assert progress == [str(n) for n in range(2, 17, 2)], "the second request kept its pairs"
    first_progress = [
        e.details["frames_done"] for e in first_events if e.stage == "encode" and e.state == "progress"
    ]
    assert first_progress == ["8", "16"], "the first request started alone and merged"


def test_cache_hit_skips_decoding_and_encoding(adapter, media_files, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    first, _ = _encode(engine, data, SamplingOptions(num_frames=8))
    again, events = _encode(engine, data, SamplingOptions(num_frames=8))
    assert not first.cache_hit and again.cache_hit
    assert torch.equal(first.embeds, again.embeds) and again.meta == first.meta
    assert [e.stage for e in events] == ["encode"] and events[0].details["cache"] == "hit"
    by_hash, _ = _encode(engine, None, SamplingOptions(num_frames=8), sha=hashlib.sha256(data).hexdigest())
    assert by_hash.cache_hit and torch.equal(by_hash.embeds, first.embeds)
    stats = engine.cache.stats()
    assert (stats.num_hits, stats.num_misses) == (2, 1)


@pytest.mark.parametrize(
    "change",
    [
        {"num_frames": 6},
        {"num_frames": 8, "max_pixels": 64 * 48},
        {"num_frames": 8, "start_time_s": 1.0},
    ],
)
def test_cache_key_changes_with_sampling(adapter, media_files, change, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    _encode(engine, data, SamplingOptions(num_frames=8))
    out, _ = _encode(engine, data, SamplingOptions(**change))
    assert not out.cache_hit


@pytest.mark.parametrize("budget_bytes", [None, 0], ids=["cache-on", "cache-off"])
def test_a_video_asked_about_twice_at_once_is_decoded_and_encoded_once(
    adapter, media_files, budget_bytes, closing
):
    """Two requests about the same new video at the same time: the second waits for the first's
    encode (encoder_svc/single_flight.py) and gets its tokens as a hit, even with the token cache
    off; by-hash too. The first is held in its decode until the others wait, so the overlap is
    certain, not a race."""
    cache = TokenCacheConfig() if budget_bytes is None else TokenCacheConfig(memory_budget_bytes=budget_bytes)
    engine = closing(EncoderEngine(EncoderConfig(cache=cache), adapter))
    data = media_files["mp4"].read_bytes()
    sampling = SamplingOptions(num_frames=8)
    key = engine.cache_key(hashlib.sha256(data).hexdigest(), sampling)
    real, decodes = engine._decode_and_encode, []

    def held(*args, **kwargs):
        decodes.append(1)
        deadline = time.monotonic() + 10
        while engine.flights.num_waiting(key) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(*args, **kwargs)

    engine._decode_and_encode = held
    sha = hashlib.sha256(data).hexdigest()
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_encode, engine, data, sampling)
        while engine.flights.num_waiting(key) == 0 and not decodes:
            time.sleep(0.005)
        second = pool.submit(_encode, engine, data, sampling)
        by_hash = pool.submit(_encode, engine, None, sampling, sha)
        (a, _), (b, events), (c, _) = first.result(30), second.result(30), by_hash.result(30)
    assert len(decodes) == 1 and engine.flights.num_shared == 2
    assert not a.cache_hit and b.cache_hit and c.cache_hit
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.embeds, c.embeds) and b.meta == a.meta
    assert [e.stage for e in events] == ["encode"] and events[0].details["shared_with"] == "in-flight request"


def test_a_request_waiting_on_a_failed_encode_does_the_work_itself(adapter, media_files, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    sampling = SamplingOptions(num_frames=4)
    key = engine.cache_key(hashlib.sha256(data).hexdigest(), sampling)
    real, calls = engine._decode_and_encode, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            while engine.flights.num_waiting(key) < 1:
                time.sleep(0.01)
            raise RuntimeError("the first request's decode failed")
        return real(*args, **kwargs)

    engine._decode_and_encode = first_fails
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_encode, engine, data, sampling)
        while not calls:
            time.sleep(0.005)
        second = pool.submit(_encode, engine, data, sampling)
        with pytest.raises(RuntimeError, match="decode failed"):
            first.result(30)
        out, _ = second.result(30)
    assert len(calls) == 2 and not out.cache_hit and engine.flights.num_shared == 0


def test_a_shared_encode_runs_as_its_flight_not_in_its_leaders_context(adapter, media_files, closing):
    """A shared encode (`single_flight`) is no single request's: the work runs under its flight's
    id, with no client deadline, not in the context of the request that started it. Here the
    leader's client deadline has passed and its caller leaves while another request waits on the
    work: the work goes on for the waiter, which gets its tokens. Nothing in the encoder reads the
    deadline today, so the context the work sees is what is checked: before, it was the leader's
    (its id in the work's log lines after it left, its deadline for any check to come)."""
    import contextvars

    from epd.encoder_svc.single_flight import Interest, flight_id
    from epd.stages.deadline import client_deadline, set_client_deadline
    from epd.stages.request_id import current_request_id, set_request_id

    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    sampling = SamplingOptions(num_frames=4)
    key = engine.cache_key(hashlib.sha256(data).hexdigest(), sampling)
    real, seen, leader_left = engine._decode_and_encode, [], threading.Event()

    def held(*args, **kwargs):  # the work, on the leader's thread
        seen.append((current_request_id(), client_deadline()))
        assert leader_left.wait(30)
        return real(*args, **kwargs)

    engine._decode_and_encode = held
    leader = Interest("leader")

    def as_request(request_id, deadline_s, interest):  # in a context of its own, as a request's task
        set_request_id(request_id)
        set_client_deadline(deadline_s)
        events = []
        return engine.encode(MediaInput(data), sampling, events.append, interest=interest), events

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(contextvars.Context().run, as_request, "leader", 0.0, leader)
        while not seen:
            time.sleep(0.005)
        second = pool.submit(contextvars.Context().run, as_request, "waiter", None, Interest("waiter"))
        while engine.flights.num_waiting(key) < 1:
            time.sleep(0.005)
        assert leader.leave()  # its client gave up: the work goes on for the waiter
        leader_left.set()
        (waited, events), _ = second.result(30), first.result(30)
    assert seen == [(flight_id(key), None)]
    assert waited.cache_hit and events[0].details["shared_with"] == "in-flight request"


def test_unknown_hash_is_not_found(adapter, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    with pytest.raises(NotFound, match="not cached here; send the file itself"):
        _encode(engine, None, SamplingOptions(), sha="cd" * 32)


def test_stack_cache_by_bytes_and_by_hash_and_across_restart(tiny_models, media_files, tmp_path):
    extra = {"encoder": ["--cache-dir", str(tmp_path / "token-cache")]}
    data = media_files["mp4_b"].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    with (
        Stack(tiny_models["qwen2_vl"], tmp_path / "logs1", extra=extra) as stack,
        EpdClient(stack.gateway) as c,
    ):
        miss = c.ask(data, QUESTION, num_frames=8, max_new_tokens=8)
        hit = c.ask(data, QUESTION, num_frames=8, max_new_tokens=8)
        by_hash = c.ask(None, QUESTION, media_sha256=sha, num_frames=8, max_new_tokens=8)
    assert not miss.encoder_cache_hit and hit.encoder_cache_hit and by_hash.encoder_cache_hit
    assert miss.token_ids == hit.token_ids == by_hash.token_ids
    assert hit.timings_ms["decode"] == 0.0 and hit.timings_ms["encode"] == 0.0
    with (
        Stack(tiny_models["qwen2_vl"], tmp_path / "logs2", extra=extra) as stack,
        EpdClient(stack.gateway) as c,
    ):
        after_restart = c.ask(None, QUESTION, media_sha256=sha, num_frames=8, max_new_tokens=8)
        with pytest.raises(EpdError, match="not cached"):
            c.ask(None, QUESTION, media_sha256=sha, num_frames=6, max_new_tokens=8)
    assert after_restart.encoder_cache_hit and after_restart.token_ids == miss.token_ids


@pytest.mark.parametrize("limit", ["max_visual_tokens", "max_duration_s"])
def test_a_restart_with_a_lower_limit_refuses_cached_entries_by_bytes_and_by_hash(
    adapter, media_files, tmp_path, limit, closing
):
    """Disk-tier entries outlive the limits they were made under: an encoder restarted with a lower
    --max-visual-tokens or --max-duration-s refuses them as it refuses the same request uncached
    (a hit used to skip both checks), and serves them again under limits they fit."""
    from dataclasses import replace

    from epd.stages.errors import ResourceExhausted
    from epd.video.types import MediaLimitError

    over_limit = (ResourceExhausted, MediaLimitError)  # both RESOURCE_EXHAUSTED
    cache = TokenCacheConfig(disk_dir=str(tmp_path / "token-cache"))
    data = media_files["mp4"].read_bytes()  # 8 s
    sha = hashlib.sha256(data).hexdigest()
    sampling = SamplingOptions(num_frames=16)
    made, _ = _encode(closing(EncoderEngine(EncoderConfig(cache=cache), adapter)), data, sampling)
    if limit == "max_visual_tokens":
        lower = EncoderConfig(cache=cache, max_visual_tokens=made.meta.num_visual_tokens - 1)
    else:
        lower = EncoderConfig(cache=cache, limits=replace(EncoderConfig().limits, max_duration_s=5.0))
    uncached = closing(EncoderEngine(replace(lower, cache=TokenCacheConfig(memory_budget_bytes=0)), adapter))
    with pytest.raises(over_limit) as miss:
        _encode(uncached, data, sampling)
    restarted = closing(EncoderEngine(lower, adapter))
    for media, media_sha in ((data, ""), (None, sha)):
        with pytest.raises(over_limit) as hit:
            _encode(restarted, media, sampling, media_sha)
        assert str(hit.value) == str(miss.value)
    again, _ = _encode(closing(EncoderEngine(EncoderConfig(cache=cache), adapter)), None, sampling, sha)
    assert again.cache_hit and again.meta == made.meta


def test_an_entry_that_does_not_record_its_duration_is_a_miss(adapter, media_files, tmp_path, closing):
    """An entry written before entries recorded their video's duration cannot be held to
    --max-duration-s: it is a miss (by hash, not found; by bytes, decoded and checked again)."""
    cache = TokenCacheConfig(disk_dir=str(tmp_path / "token-cache"))
    data = media_files["mp4_b"].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    sampling = SamplingOptions(num_frames=4)
    engine = closing(EncoderEngine(EncoderConfig(cache=cache), adapter))
    made, _ = _encode(engine, data, sampling)
    engine.cache.put(engine.cache_key(sha, sampling), made)  # as the encoder used to put it: no facts
    restarted = closing(EncoderEngine(EncoderConfig(cache=cache), adapter))
    with pytest.raises(NotFound, match="not cached here"):
        _encode(restarted, None, sampling, sha)
    by_bytes, _ = _encode(restarted, data, sampling)
    assert not by_bytes.cache_hit
    assert _encode(restarted, None, sampling, sha)[0].cache_hit


def test_cache_can_be_disabled(adapter, media_files, closing):
    engine = closing(EncoderEngine(EncoderConfig(cache=TokenCacheConfig(memory_budget_bytes=0)), adapter))
    data = media_files["mp4"].read_bytes()
    _encode(engine, data, SamplingOptions(num_frames=4))
    out, _ = _encode(engine, data, SamplingOptions(num_frames=4))
    assert not out.cache_hit


def test_decord_backend_gives_the_same_tokens(adapter, media_files, closing):
    from epd.video.decord_backend import decord_available

    if not decord_available():
        pytest.skip("decord is not installed (optional backend: pip install 'epd[decord]')")
    data = media_files["mp4"].read_bytes()
    sampling = SamplingOptions(num_frames=8)
    pyav, _ = _encode(closing(EncoderEngine(EncoderConfig(), adapter)), data, sampling)
    engine = EncoderEngine(EncoderConfig(decode_backend="decord"), adapter)
    try:
        dec, _ = _encode(engine, data, sampling)
    finally:
        engine.close()
    assert dec.meta == pyav.meta and dec.frame_timestamps_s == pyav.frame_timestamps_s
    assert torch.equal(dec.embeds, pyav.embeds)


def test_the_decord_backend_gives_pyav_a_long_hevc_video_asked_near_its_end(adapter, tmp_path, closing):
    """decord reads HEVC from the first frame (it cannot seek in it): four frames near the end of
    a 60 s clip took ~600 decoded frames, over --max-decoded-pixels (100 frames here), where PyAV
    seeks and stays within it. The encoder hands such a request to PyAV: the same tokens as the
    PyAV backend's, no refusal."""
    from epd.video.budget import MIN_PIXELS_PER_FRAME
    from epd.video.decord_backend import decord_available
    from epd.video.types import DecodeLimits
    from tests.media import encoder_available, make_video

    if not decord_available() or not encoder_available("hevc"):
        pytest.skip("decord (optional backend) or an HEVC encoder is not installed")
    data = make_video(tmp_path / "long.mp4", codec="hevc", size=(96, 64), fps=10.0, seconds=60.0,
                      gop=10).read_bytes()  # fmt: skip
    sampling = SamplingOptions(num_frames=4, start_time_s=55.0)
    limits = DecodeLimits(max_decoded_pixels=100 * MIN_PIXELS_PER_FRAME)
    pyav, _ = _encode(closing(EncoderEngine(EncoderConfig(limits=limits), adapter)), data, sampling)
    engine = EncoderEngine(EncoderConfig(decode_backend="decord", limits=limits), adapter)
    try:
        handed, _ = _encode(engine, data, sampling)
    finally:
        engine.close()
    assert handed.frame_timestamps_s == pyav.frame_timestamps_s and torch.equal(handed.embeds, pyav.embeds)


@pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"device": "cuda"}, {"linear_kernel": "onednn"}])
def test_the_key_holds_the_numerics_the_tower_runs_in(adapter, change, closing):
    """The disk tier outlives the process and may be shared: a bfloat16 encoder was handed a float32
    encoder's embeddings (and the reverse, so a lossless float32 answer was no longer generate()'s)."""
    sha, sampling = "ab" * 32, SamplingOptions(num_frames=8)
    float32 = closing(EncoderEngine(EncoderConfig(), adapter)).cache_key(sha, sampling)
    other = closing(EncoderEngine(EncoderConfig(model=ModelConfig(**change)), adapter)).cache_key(
        sha, sampling
    )
    assert other != float32
    same_kind = closing(EncoderEngine(EncoderConfig(model=ModelConfig(device="cpu")), adapter)).cache_key(
        sha, sampling
    )
    assert same_kind == float32


def test_a_hub_model_s_identity_is_its_downloaded_snapshot(tmp_path, monkeypatch):
    """The id alone ("org/name") stayed the same when the hub's model changed under it."""
    import huggingface_hub.constants

    from epd.model_runtime.hf_loading import fingerprint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny-vlm"
    for commit, hidden in (("a" * 40, 64), ("b" * 40, 128)):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(f'{{"hidden_size": {hidden}}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    first = fingerprint("org/tiny-vlm")
    assert fingerprint("org/tiny-vlm") == first
    (repo / "refs" / "main").write_text("b" * 40)  # the hub's model changed; transformers fetched it
    assert fingerprint("org/tiny-vlm") != first
    assert fingerprint("org/not-downloaded") != first  # no snapshot: the id is all there is
