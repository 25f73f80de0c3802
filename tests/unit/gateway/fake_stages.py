"""Fake stages (no model, no gRPC) for the gateway pipeline's unit tests: an encoder, a prefill and a
decoder that answer at once (a video's embeddings, a prefill handle, one token). The encoder and
prefill report the transfer bytes they are made with (`pruning.transfer_bytes`), the decoder a KV
pull of `KV_PULLED_BYTES`; the decoder finds its first `num_lost` caches gone (`KvSourceLost`)."""

from __future__ import annotations

from epd.model_runtime.adapter import VisualMeta
from epd.stages import contracts
from epd.stages.contracts import PrefillHandle, TokenStep
from epd.stages.errors import KvSourceLost
from epd.token_pruning import PruningStats
from epd.transport.tensor_wire import WireTensor

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
