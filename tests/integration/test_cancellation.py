"""A client that goes away frees the work done for it, through real processes on loopback:

- gone mid-decode: the encoder logs the request cancelled and stops its decoding at the next frame
  group, and the next request is answered;
- gone mid-decode while a second request waits on the same media (the encoder's single flight):
  the decode goes on for the second, which gets the exact answer (that of an independent decode,
  under another cache salt), and the encoder decoded the media once (its log);
- gone right after prefill (20 times): the prefill KV store is empty again each time, and no
  following request gets RESOURCE_EXHAUSTED from a store that would hold only two leaked caches;
- a decoder that cannot pull (its --allow-kv-from refuses the prefill): the gateway releases each
  cache, so 20 failed requests leave the store empty.

The store is read through PrefillService.ReleaseKv, which answers what the store still holds.
Waits poll with a deadline only so that a broken build fails instead of hanging.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from epd.client import AskResult, AsyncEpdClient, EpdClient, EpdError, StageEvent
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from tests.media import make_video
from tests.stack import Stack, VerboseStack, wait_until

QUESTION = "what colour is the square?"
SMALL = {"num_frames": 4, "max_new_tokens": 4}
KV_STORE_BYTES = 100_000  # holds two KV caches of SMALL requests (checked below): a third is refused
WAIT_S = 120.0


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"prefill": ["--kv-store-bytes", str(KV_STORE_BYTES)], "encoder": ["--decode-workers", "1"]}
    with VerboseStack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_cancel"), extra=extra) as s:
        yield s


@pytest.fixture(scope="module")
def slow_clip(tmp_path_factory):
    """long_clip at 1280x720: its one decode takes the encoder about a second, so a second request
    has the time to join it before the first leaves."""
    return make_video(
        tmp_path_factory.mktemp("slow") / "slow.mp4",
        size=(1280, 720),
        fps=30.0,
        seconds=30.0,
        gop=900,
        pattern="texture",
    )


def kv_caches_held(stack: Stack) -> int:
    """What the prefill KV store holds, read through ReleaseKv of a handle that never existed."""
    with grpc.insecure_channel(stack.address("prefill")) as channel:
        answer = prefill_pb2_grpc.PrefillServiceStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(kv_handle="no-such-handle"), timeout=30
        )
    assert not answer.released
    assert (answer.num_kv_caches_held == 0) == (answer.kv_bytes_held == 0)
    return answer.num_kv_caches_held


async def _leave_after(stack: Stack, media, stage: str, state: str, **options) -> None:
    """Stream a request and cancel it (as a client that disconnects) at the first event of
    `stage`/`state`. A request that ends before that is a failure of the test's setup."""
    async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S) as client:
        reached = asyncio.Event()

        async def consume() -> None:
            async for item in client.stream(media, QUESTION, **options):
                if isinstance(item, StageEvent) and (item.stage, item.state) == (stage, state):
                    reached.set()
                assert not isinstance(item, AskResult), "the request ended before the client left"

        task = asyncio.ensure_future(consume())
        waiter = asyncio.ensure_future(reached.wait())
        await asyncio.wait([task, waiter], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        assert reached.is_set(), task.exception() if task.done() else f"no {stage} {state} event"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_a_client_that_disconnects_mid_decode_frees_the_encoder(stack, long_clip, media_files):
    asyncio.run(
        _leave_after(
            stack,
            long_clip,
            "video_decode",
            "started",
            num_frames=256,
            max_frames=256,
            max_new_tokens=4,
            request_id="gone-mid-decode",
        )
    )
    log = stack.log_dir / "encoder.log"
    wait_until(
        lambda: "encode of request gone-mid-decode cancelled by its caller" in log.read_text(),
        "the encoder's cancel",
    )
    wait_until(
        lambda: "encode of request gone-mid-decode stopped: cancelled" in log.read_text(),
        "the encoder's stop (demux pass, frame wait or next group)",
    )
    with EpdClient(stack.gateway, timeout_s=WAIT_S) as client:
        answer = client.ask(media_files["mp4"], QUESTION, **SMALL)
    assert len(answer.token_ids) == SMALL["max_new_tokens"]


def _log_has(stack: Stack, *parts: str) -> bool:
    return any(
        all(p in line for p in parts) for line in (stack.log_dir / "encoder.log").read_text().splitlines()
    )


def test_a_shared_decode_goes_on_for_the_waiting_request_when_its_leader_leaves(stack, slow_clip):
    """The first request leads the decode of a slow clip; a second about the same clip waits on it
    (the encoder logs the wait); the first leaves mid-decode. Before, the second then took the work
    over and decoded the clip again from its first frame; now the decode goes on for it."""
    # Many frames (a decode of seconds) but small ones: the KV cache fits the stack's small store.
    options = dict(num_frames=32, max_pixels=64 * 48, max_new_tokens=4)
    decodes_before = (stack.log_dir / "encoder.log").read_text().count("decoding and encoding media")

    async def scenario() -> AskResult:
        async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S) as client:
            started = asyncio.Event()

            async def lead() -> None:
                async for item in client.stream(slow_clip, QUESTION, request_id="leader-leaves", **options):
                    if isinstance(item, StageEvent) and (item.stage, item.state) == (
                        "video_decode",
                        "started",
                    ):
                        started.set()
                    assert not isinstance(item, AskResult), "the leader ended before it left"

            leader = asyncio.ensure_future(lead())
            await asyncio.wait_for(started.wait(), WAIT_S)
            waiter = asyncio.ensure_future(
                client.ask(slow_clip, QUESTION, request_id="waits-on-it", **options)
            )
            await asyncio.to_thread(
                wait_until,
                lambda: _log_has(stack, "waiting for the encode of media", "waits-on-it"),
                "the second request's wait on the first's encode",
            )
            assert not leader.done(), "the leader ended before it left"
            leader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leader
            return await asyncio.wait_for(waiter, WAIT_S)

    answer = asyncio.run(scenario())
    log = (stack.log_dir / "encoder.log").read_text()
    assert log.count("decoding and encoding media") - decodes_before == 1, "the clip was decoded again"
    assert _log_has(
        stack, "encode of request leader-leaves cancelled by its caller", "go on for the requests waiting"
    )
    assert not _log_has(stack, "encode of request leader-leaves stopped")
    with EpdClient(stack.gateway, timeout_s=WAIT_S) as client:  # another salt: decoded anew, alone
        reference = client.ask(slow_clip, QUESTION, cache_salt="reference", **options)
    assert answer.token_ids == reference.token_ids
    assert answer.answer == reference.answer


def test_clients_that_leave_right_after_prefill_leave_no_kv_cache(stack, media_files):
    with EpdClient(stack.gateway, timeout_s=WAIT_S) as client:
        answer = client.ask(media_files["mp4"], QUESTION, **SMALL)
    assert 2 * answer.kv_num_bytes < KV_STORE_BYTES < 3 * answer.kv_num_bytes
    assert kv_caches_held(stack) == 0
    for i in range(20):
        # A long answer (ignore_eos), so that the client leaves while it is being generated.
        asyncio.run(
            _leave_after(
                stack,
                media_files["mp4"],
                "prefill",
                "finished",
                num_frames=4,
                max_new_tokens=1000,
                ignore_eos=True,
                request_id=f"gone-after-prefill-{i}",
            )
        )
        wait_until(lambda: kv_caches_held(stack) == 0, "an empty KV store")
        with EpdClient(stack.gateway, timeout_s=WAIT_S) as client:
            answer = client.ask(media_files["mp4"], QUESTION, **SMALL)  # no RESOURCE_EXHAUSTED
        assert len(answer.token_ids) == SMALL["max_new_tokens"]
    decode_log = (stack.log_dir / "decode.log").read_text()
    assert (
        "generation of request gone-after-prefill-" in decode_log and "cancelled by its caller" in decode_log
    )


@pytest.fixture(scope="module")
def stack_without_pull(tiny_models, tmp_path_factory):
    """Its decoder refuses to pull from the prefill (not in --allow-kv-from)."""
    extra = {
        "prefill": ["--kv-store-bytes", str(KV_STORE_BYTES)],
        "decode": ["--allow-kv-from", "10.9.9.9:1"],
    }
    with VerboseStack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_nopull"), extra=extra) as s:
        yield s


def test_a_decoder_that_cannot_pull_leaves_no_kv_cache(stack_without_pull, media_files):
    with EpdClient(stack_without_pull.gateway, timeout_s=WAIT_S) as client:
        for _ in range(20):
            with pytest.raises(EpdError) as failure:
                client.ask(media_files["mp4"], QUESTION, **SMALL)
            assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT, failure.value
            assert "--allow-kv-from" in str(failure.value)
    wait_until(lambda: kv_caches_held(stack_without_pull) == 0, "an empty KV store")
    assert (stack_without_pull.log_dir / "prefill.log").read_text().count(
        "ended before a decoder pulled it"
    ) == 20
