"""The KV handover between prefill and decode through real processes on loopback
(prefill_svc/kv_store.py lease/confirm, decode_svc/kv_pull.py):

- a PullKv cut off half way leaves the cache at prefill: it is pulled again, whole and the same,
  and a decoder given the handle afterwards answers the same tokens as for an untouched handle;
  the decoder's confirmation drops the cache (NOT_FOUND afterwards, the store empty);
- a cache leased and never confirmed (its decoder died) is gone after the TTL (--kv-ttl);
- the store on the gateway's /metrics: caches held, their bytes and the budget, and the caches
  dropped before a decoder had them, released or expired (seen at the TTL by the scrape itself);
- a gateway killed (SIGKILL) mid-answer: its client gets UNAVAILABLE, the decoder's running count
  returns to 0 (its call was cancelled when the connection dropped), nothing stays at prefill,
  and a gateway restarted on the same port serves again.

Waits poll with a deadline only so that a broken build fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import subprocess
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.cli.health import is_serving
from epd.client import EpdClient, EpdError, TokenDelta
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput, PrefillHandle
from epd.stages.messages import question_messages
from epd.transport import convert
from epd.transport.load import fetch_loads
from epd.transport.remote_encode import RemoteEncodeStage
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from epd.video.types import SamplingOptions
from tests.stack import ROOT, Stack, VerboseStack, child_env, wait_until

QUESTION = "what colour is the square?"
KV_TTL_S = 5.0
KV_STORE_BYTES = 256 << 20
WAIT_S = 120.0
MAX_TRANSFER_BYTES = 1 << 30


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    # No prefix cache: the two prefills of one question below must compute the same KV afresh.
    extra = {"prefill": ["--kv-ttl", str(KV_TTL_S), "--prefix-cache-bytes", "0", "--kv-store-bytes", str(KV_STORE_BYTES)]}  # fmt: skip
    with VerboseStack(
        tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_kv"), extra=extra, http=True
    ) as s:
        yield s


def kv_caches_held(stack: Stack, release: str = "no-such-handle") -> int:
    """The caches prefill holds, once it released `release` (as the gateway does when a request
    ends; by default a handle no cache has)."""
    with grpc.insecure_channel(stack.address("prefill")) as channel:
        answer = prefill_pb2_grpc.PrefillServiceStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(kv_handle=release), timeout=30
        )
    return answer.num_kv_caches_held


def kv_store_metrics(stack: Stack) -> dict[str, float]:
    """Prefill's KV store series on the gateway's /metrics (where an operator scrapes them):
    name (with `:reason` for the drops) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {
        sample.name + (f":{sample.labels['reason']}" if "reason" in sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("epd_kv_store_") and sample.labels["replica"] == stack.address("prefill")
    }


async def prefilled(stack: Stack, video: bytes, request_id: str) -> PrefillHandle:
    """Encode and prefill through the real services (as the gateway does), no decode."""
    encoder = RemoteEncodeStage(ReplicaPool([stack.address("encoder")]), 60.0, MAX_TRANSFER_BYTES)
    prefill = RemotePrefillStage(ReplicaPool([stack.address("prefill")]), 60.0)
    try:
        media = await encoder.encode(
            MediaInput(video), SamplingOptions(num_frames=4), lambda e: None, request_id
        )
        return await prefill.prefill(
            question_messages(QUESTION), media, GenerationConfig(max_new_tokens=4), request_id
        )
    finally:
        await encoder.close()
        await prefill.close()


async def pull_chunks(stack: Stack, handle: str, keep: bool = True, stop_after: int = 0) -> list[bytes]:
    """The KvChunks' bytes (name, offset, data) of one PullKv; `stop_after` > 0 cancels it then."""
    async with grpc.aio.insecure_channel(stack.address("prefill")) as channel:
        call = prefill_pb2_grpc.PrefillServiceStub(channel).PullKv(
            prefill_pb2.PullKvRequest(kv_handle=handle, keep_until_confirmed=keep), timeout=60
        )
        got: list[bytes] = []
        async for msg in call:
            got.append(msg.tensor.SerializeToString())
            if stop_after and len(got) == stop_after:
                call.cancel()
                break
        return got


async def generate(stack: Stack, handle: PrefillHandle, request_id: str) -> list[int]:
    request = decode_pb2.GenerateRequest(
        request_id=request_id,
        prefill=convert.handle_to_proto(handle),
        generation=convert.generation_to_proto(GenerationConfig(max_new_tokens=4)),
    )
    async with grpc.aio.insecure_channel(stack.address("decode")) as channel:
        tokens: list[int] = []
        async for step in decode_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            tokens += step.token_ids
        return tokens


def test_a_broken_pull_is_pulled_again_and_confirmed(stack, media_files):
    video = media_files["mp4"].read_bytes()

    async def scenario():
        untouched = await prefilled(stack, video, "kv-untouched")
        reference = await generate(stack, untouched, "kv-untouched")

        handle = await prefilled(stack, video, "kv-broken")
        half = await pull_chunks(stack, handle.kv_handle, stop_after=1)
        whole = await pull_chunks(stack, handle.kv_handle)
        again = await pull_chunks(stack, handle.kv_handle)
        held_before = kv_caches_held(stack)
        tokens = await generate(stack, handle, "kv-broken")  # the decoder pulls it a 4th time
        held_after = kv_caches_held(stack)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await pull_chunks(stack, handle.kv_handle)
        return reference, half, whole, again, held_before, tokens, held_after, gone.value

    reference, half, whole, again, held_before, tokens, held_after, gone = asyncio.run(scenario())
    assert len(half) == 1 and len(whole) > 1  # the first pull really stopped half way
    assert whole == again and whole[0] == half[0]
    assert held_before == 1
    assert tokens == reference and len(tokens) == 4
    assert held_after == 0  # the decoder confirmed receipt: dropped at once, not at the TTL
    assert gone.code() == grpc.StatusCode.NOT_FOUND
    log = (stack.log_dir / "prefill.log").read_text()
    assert "pulled again (pull 4)" in log
    assert "KV cache of request kv-broken handed over: its decoder confirmed receipt" in log


def test_a_pull_without_confirmation_hands_over_at_once(stack, media_files):
    """What a decoder that does not confirm (0.1) asks for: the cache is gone once streamed."""

    async def scenario():
        handle = await prefilled(stack, media_files["mp4"].read_bytes(), "kv-legacy")
        chunks = await pull_chunks(stack, handle.kv_handle, keep=False)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await pull_chunks(stack, handle.kv_handle)
        return chunks, gone.value

    chunks, gone = asyncio.run(scenario())
    assert chunks and gone.code() == grpc.StatusCode.NOT_FOUND
    assert kv_caches_held(stack) == 0


def test_a_leased_cache_never_confirmed_expires(stack, media_files):
    """A decoder that pulled and died before confirming (and no gateway to release): the TTL."""

    async def scenario():
        handle = await prefilled(stack, media_files["mp4"].read_bytes(), "kv-orphan")
        await pull_chunks(stack, handle.kv_handle, stop_after=2)
        return handle

    handle = asyncio.run(scenario())
    assert kv_caches_held(stack) == 1
    wait_until(lambda: kv_caches_held(stack) == 0, "the leased cache's expiry")
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        asyncio.run(pull_chunks(stack, handle.kv_handle))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown or expired" in gone.value.details()


def test_the_kv_store_is_on_the_gateways_metrics(stack, media_files):
    """Caches no decoder pulls: held (count, bytes, against the budget), then one released by
    its request's end and one dropped at its TTL, each counted by reason."""
    video = media_files["mp4"].read_bytes()
    before = kv_store_metrics(stack)
    assert before["epd_kv_store_total_bytes"] == KV_STORE_BYTES
    assert before["epd_kv_store_caches"] == 0 and before["epd_kv_store_used_bytes"] == 0

    async def two() -> list[PrefillHandle]:
        return [await prefilled(stack, video, f"kv-metrics-{i}") for i in range(2)]

    released, expiring = asyncio.run(two())
    held = kv_store_metrics(stack)
    assert held["epd_kv_store_caches"] == 2
    assert held["epd_kv_store_used_bytes"] == released.kv_num_bytes + expiring.kv_num_bytes > 0

    assert kv_caches_held(stack, release=released.kv_handle) == 1
    after_release = kv_store_metrics(stack)
    assert after_release["epd_kv_store_caches"] == 1
    assert after_release["epd_kv_store_used_bytes"] == expiring.kv_num_bytes
    dropped = "epd_kv_store_dropped_total:"
    assert after_release[dropped + "released"] == before[dropped + "released"] + 1
    assert after_release[dropped + "expired"] == before[dropped + "expired"]

    # Nothing else touches the store meanwhile: the scrape itself must see the TTL pass.
    wait_until(lambda: kv_store_metrics(stack)["epd_kv_store_caches"] == 0, "the unpulled cache's expiry")
    expired = kv_store_metrics(stack)
    assert expired["epd_kv_store_used_bytes"] == 0
    assert expired[dropped + "expired"] == before[dropped + "expired"] + 1
    assert expired[dropped + "released"] == after_release[dropped + "released"]


def decode_running(stack: Stack) -> int:
    async def read() -> int:
        async with grpc.aio.insecure_channel(stack.address("decode")) as channel:
            return sum(load.num_running for load in await fetch_loads(channel, 10.0))

    return asyncio.run(read())


def test_a_killed_gateway_fails_its_requests_clearly(stack, media_files):
    client = EpdClient(stack.gateway, timeout_s=120.0, metadata=(("x-request-id", "killed-gw-1"),))
    tokens = 0
    with pytest.raises(EpdError) as failed:
        for item in client.stream(
            media_files["mp4"],
            QUESTION,
            num_frames=4,
            max_new_tokens=4000,
            ignore_eos=True,
            request_id="killed-gw-1",
        ):
            if isinstance(item, TokenDelta) and item.token_ids:
                tokens += len(item.token_ids)
                # The first token comes with prefill's answer, the second from the decoder, which
                # confirms its KV receipt once its first step went out: killed then, the gateway
                # leaves nothing at prefill (killed earlier, it would leave the cache to the TTL).
                if tokens >= 2 and stack.procs["gateway"].poll() is None:
                    stack.procs["gateway"].kill()  # SIGKILL: no drain, no goodbye
    client.close()
    assert tokens >= 2
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE
    # The decoder's call was cancelled with the connection: its running request is gone.
    wait_until(lambda: decode_running(stack) == 0, "the decoder dropping the dead gateway's request")
    wait_until(
        lambda: (
            "generation of request killed-gw-1 cancelled by its caller"
            in (stack.log_dir / "decode.log").read_text()
        ),
        "the decoder's cancellation line",
    )
    decode_log = (stack.log_dir / "decode.log").read_text()
    assert "rpc /epd.v1.DecodeService/Generate CANCELLED" in decode_log
    assert "num_tokens=4000" not in decode_log  # it did not simply finish
    assert kv_caches_held(stack) == 0  # pulled and confirmed before the kill: nothing left

    # A restarted gateway (same port) serves again.
    with open(stack.log_dir / "gateway-restarted.log", "w") as log:
        stack.procs["gateway"] = subprocess.Popen(
            stack.command("gateway"), stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT
        )
    wait_until(lambda: is_serving(stack.gateway, timeout_s=1.0), "the restarted gateway serving")
    with EpdClient(stack.gateway, timeout_s=120.0) as again:
        result = again.ask(media_files["mp4"], QUESTION, num_frames=4, max_new_tokens=4)
    assert len(result.token_ids) == 4
