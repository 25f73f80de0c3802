"""The encoder's per-request driver runs off the model thread, in one process with the real tiny
model (no servers):

- a request whose frames are not coming (blocked deterministically with a threading.Event inside
  its frame stream) does not stop another request's encode from finishing, and both get the tokens
  they get alone;
- cancelling an encode sets its flag: no tower call follows and the frame stream is closed.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Generator

import pytest
import torch

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.stage import LocalEncodeStage
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.stages.contracts import MediaInput, StageEvent
from epd.stages.model_thread import ModelThread
from epd.video.types import DecodedVideo, SamplingOptions
from tests.unit.plumbing.pipeline_asks import HANG_GUARD_S

SAMPLING = SamplingOptions(num_frames=6)  # 3 frame groups of 2


class Gate:
    """Stands in the frame stream of one request: hands out the first group, then blocks
    (as a slow demux or decode would) until the test opens it."""

    def __init__(self) -> None:
        self.blocked = threading.Event()  # the first group is out, the second is being waited for
        self.open = threading.Event()
        self.closed = threading.Event()  # the driver closed the stream
        self.num_groups_out = 0

    def wrap(self, groups: Generator[DecodedVideo, None, None]) -> Generator[DecodedVideo, None, None]:
        try:
            for video in groups:
                if self.num_groups_out == 1:
                    self.blocked.set()
                    if not self.open.wait(HANG_GUARD_S):
                        raise RuntimeError("the gate was never opened")
                self.num_groups_out += 1
                yield video
        finally:
            groups.close()  # the real stream: cancels its pending decode work
            self.closed.set()


class GatedEngine(EncoderEngine):
    """The real engine; the frames of media listed in `gates` pass through a Gate."""

    gates: dict[str, Gate]

    def open_frames(self, data, sha256, sampling, cancel=None, merge=False, cache_salt=""):
        meta, groups = super().open_frames(data, sha256, sampling, cancel, merge, cache_salt)
        gate = self.gates.get(sha256)
        return meta, (gate.wrap(groups) if gate else groups)


def _engine(adapter, cls=EncoderEngine, **config) -> EncoderEngine:
    config = {"merge_decoded_groups": False, **config}  # groups as decoded pairs: the Gate counts them
    engine = cls(EncoderConfig(cache=TokenCacheConfig(memory_budget_bytes=0), **config), adapter)
    engine.gates = {}
    return engine


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _wait(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, HANG_GUARD_S), "the test would hang here"


def test_a_blocked_decode_does_not_stop_another_requests_encode(adapter, videos, closing):
    """A waits for its second frame group (blocked) while B is encoded from start to end; B and A
    then give the same tokens as each encoded alone."""
    engine = _engine(adapter, GatedEngine)
    gate = engine.gates[_sha(videos["mp4"])] = Gate()
    stage = LocalEncodeStage(engine, ModelThread())

    async def scenario():
        task_a = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4"]), SAMPLING, lambda e: None, "a"))
        await _wait(gate.blocked)
        events_b: list[StageEvent] = []
        out_b = await asyncio.wait_for(
            stage.encode(MediaInput(videos["mp4_b"]), SAMPLING, events_b.append, "b"), HANG_GUARD_S
        )
        assert not task_a.done(), "A cannot have finished: its frames are held back"
        gate.open.set()
        return await task_a, out_b, events_b

    out_a, out_b, events_b = asyncio.run(scenario())
    assert gate.num_groups_out == 3 and gate.closed.is_set()
    assert [e.details["frames_done"] for e in events_b if e.state == "progress" and e.stage == "encode"] == [
        "2",
        "4",
        "6",
    ]
    alone = closing(_engine(adapter))
    for data, out in ((videos["mp4"], out_a), (videos["mp4_b"], out_b)):
        ref = alone.encode(MediaInput(data), SAMPLING, lambda e: None)
        assert out.meta == ref.meta
        torch.testing.assert_close(out.embeds, ref.embeds, rtol=0, atol=0)
    stage.close()  # its request drivers and decode workers; the model thread is the test's
    stage.model_thread.close()


def test_cancel_sets_the_flag_stops_tower_calls_and_closes_the_stream(adapter, videos, monkeypatch):
    # One group queued at a time, so the tower calls are countable: A 1, B one per group.
    engine = _engine(
        adapter, GatedEngine, max_concurrent_decodes=1, max_queued_decodes=1, max_tower_jobs_per_request=1
    )
    gate = engine.gates[_sha(videos["mp4"])] = Gate()
    tower_calls: list[str] = []
    encode = adapter.encode
    monkeypatch.setattr(adapter, "encode", lambda inputs: tower_calls.append("x") or encode(inputs))
    stage = LocalEncodeStage(engine, ModelThread())

    async def scenario():
        task_a = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4"]), SAMPLING, lambda e: None, "a"))
        await _wait(gate.blocked)
        assert len(tower_calls) == 1
        task_a.cancel()  # what gRPC does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task_a
        # B waits for the only driver slot, which A frees only once its driver has stopped.
        b = asyncio.ensure_future(stage.encode(MediaInput(videos["mp4_b"]), SAMPLING, lambda e: None, "b"))
        gate.open.set()  # A's next group arrives: the driver sees the flag there
        await _wait(gate.closed)
        return await asyncio.wait_for(b, HANG_GUARD_S)

    out_b = asyncio.run(scenario())
    assert gate.num_groups_out == 2, "the driver took one more group, then stopped"
    assert len(tower_calls) == 1 + 3, "no tower call for A after the cancel (B made 3)"
    assert stage.drivers.num_cancelled == 1 and stage.drivers.num_admitted == 0
    assert out_b.num_frames == 6
    stage.close()
    stage.model_thread.close()
