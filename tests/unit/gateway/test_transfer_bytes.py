"""The request's `pruning.transfer_bytes`, summed by the pipeline from what each hop's stage counted,
with fake stages (no model, no gRPC): the encoder -> gateway hop on the `EncodedMedia`, each prefill
call's hops on its `PrefillHandle`, the decoder's KV pull on its first step (counted only when the
cache was at a prefill server, `kv_address`; an in-process store moves nothing). The remote stages'
own counts are checked through the real stack (tests/integration/test_transfer_bytes.py)."""

from __future__ import annotations

import asyncio

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.adapter import VisualMeta
from epd.stages import contracts
from epd.stages.contracts import MediaInput, PrefillHandle, TokenStep
from epd.stages.errors import KvSourceLost
from epd.stages.messages import question_messages
from epd.token_pruning import PruningStats
from epd.transport.tensor_wire import WireTensor

ENCODER_TO_GATEWAY_BYTES = 6 * 8 * 4  # [6, 8] float32 embeddings
PREFILL_CALL_BYTES = 6 * 8 * 4 + 2 * 10  # the embeddings again, a 10-entry mask there and on to decode
KV_PULLED_BYTES = 4096


class Encoder(contracts.EncodeStage):
    def __init__(self, transfer_bytes: int) -> None:
        self.transfer_bytes = transfer_bytes

    async def encode(self, media, sampling, on_event, request_id, pruning=None, cache_salt="", priority=0):
        return contracts.EncodedMedia(
            embeds=WireTensor("float32", (6, 8), bytes(6 * 8 * 4)),
            meta=VisualMeta("video", (2, 4, 6), 1.0, 6),
            num_frames=4, frame_timestamps_s=[0.0, 0.5, 1.0, 1.5], decode_ms=1.0, encode_ms=2.0,
            pruning=PruningStats(transfer_bytes=self.transfer_bytes),
        )  # fmt: skip


class Prefill(contracts.PrefillStage):
    def __init__(self, transfer_bytes: int, kv_address: str) -> None:
        self.transfer_bytes = transfer_bytes
        self.kv_address = kv_address
        self.num_calls = 0

    async def prefill(
        self,
        messages,
        media,
        generation,
        request_id,
        pruning=None,
        cache_salt="",
        *,
        raw_prompt=None,
        template=None,
    ):
        self.num_calls += 1
        return PrefillHandle(
            first_token_id=7, num_prompt_tokens=20, num_cached_tokens=20, next_position_ids=[20, 4, 4, 4],
            kv_num_bytes=KV_PULLED_BYTES, prefill_ms=1.0, pruning=PruningStats(transfer_bytes=self.transfer_bytes),
            kv_handle=f"{self.num_calls:032x}", kv_address=self.kv_address,
        )  # fmt: skip

    async def release(self, handle, request_id):
        pass


class Decoder(contracts.DecodeStage):
    """Answers one token after its KV 'pull'; the first `num_lost` calls find the cache gone."""

    def __init__(self, num_lost: int = 0) -> None:
        self.num_lost = num_lost

    async def generate(self, handle, generation, request_id, pruning=None):
        if self.num_lost:
            self.num_lost -= 1
            raise KvSourceLost("the prefill replica is gone")
        yield TokenStep([7], "a", "stop", kv_transfer_ms=1.0, kv_num_bytes=KV_PULLED_BYTES)


def _transfer_bytes(pipeline: Pipeline) -> int:
    async def run() -> AskSummary:
        request = AskRequest(question_messages("what colour?"), MediaInput(b"\0"))
        async for item in pipeline.ask(request):
            if isinstance(item, AskSummary):
                return item
        raise AssertionError("no summary")

    return asyncio.run(run()).pruning.transfer_bytes


def test_the_hops_of_a_stack_add_up():
    pipeline = Pipeline(
        Encoder(ENCODER_TO_GATEWAY_BYTES), Prefill(PREFILL_CALL_BYTES, "prefill-0:50052"), Decoder()
    )
    assert _transfer_bytes(pipeline) == ENCODER_TO_GATEWAY_BYTES + PREFILL_CALL_BYTES + KV_PULLED_BYTES


def test_a_cache_taken_from_an_in_process_store_moves_nothing():
    """The embedded pipeline's decoder reports the KV bytes it took, but nothing crossed a process."""
    assert _transfer_bytes(Pipeline(Encoder(0), Prefill(0, ""), Decoder())) == 0


def test_a_second_prefill_after_its_cache_was_lost_counts_its_media_again():
    prefill = Prefill(PREFILL_CALL_BYTES, "prefill-0:50052")
    pipeline = Pipeline(Encoder(ENCODER_TO_GATEWAY_BYTES), prefill, Decoder(num_lost=1))
    assert _transfer_bytes(pipeline) == ENCODER_TO_GATEWAY_BYTES + 2 * PREFILL_CALL_BYTES + KV_PULLED_BYTES
    assert prefill.num_calls == 2
