"""The request's `pruning.transfer_bytes`, summed by the pipeline from what each hop's stage counted,
with fake stages (no model, no gRPC; tests/unit/gateway/fake_stages.py): the encoder -> gateway hop on
the `EncodedMedia`, each prefill call's hops on its `PrefillHandle`, the decoder's KV pull on its
first step (counted only when the cache was at a prefill server, `kv_address`; an in-process store
moves nothing). The remote stages' own counts are checked through the real stack
(tests/integration/test_transfer_bytes.py)."""

from __future__ import annotations

import asyncio

from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.pipeline import Pipeline
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from tests.unit.gateway.fake_stages import KV_PULLED_BYTES, Decoder, Encoder, Prefill

ENCODER_TO_GATEWAY_BYTES = 6 * 8 * 4  # [6, 8] float32 embeddings
PREFILL_CALL_BYTES = 6 * 8 * 4 + 2 * 10  # the embeddings again, a 10-entry mask there and on to decode


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
