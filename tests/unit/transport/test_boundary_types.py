"""One type per stage boundary, converted in one place each way: every field of EncodedMedia,
PrefillHandle, PruningStats, TokenStep and PruningConfig survives its converter (proto, and the
token cache's record). Each sample sets every field off its default, and the tests check that it
does, so a field added to a type but not to its converter fails here."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import math
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.stage import LocalDecodeStage, take_from_store
from epd.encoder_svc.token_cache import TokenCache, TokenCacheConfig, make_cache_key
from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.kv_store import KvStore
from epd.stages.contracts import (
    ChoiceStart,
    EncodedMedia,
    MediaRecord,
    PrefillHandle,
    TokenStep,
    check_generation_limits,
)
from epd.stages.errors import InvalidRequest
from epd.stages.model_thread import ModelThread
from epd.token_pruning import PruningConfig, PruningStats
from epd.transport import convert
from epd.transport.errors import status_of
from epd.transport.tensor_wire import TensorAssembler
from epd.v1 import common_pb2, encoder_pb2, prefill_pb2


def _stats() -> PruningStats:
    stats = PruningStats(
        num_key_tokens=2,
        prefill_flops_full=10**12,
        prefill_flops_pruned=4 * 10**11,
        kv_bytes_before=4096,
        kv_bytes_after=1024,
        transfer_bytes=77,
    )
    stats.record("temporal", 12, 9)
    stats.record("spatial_merge", 9, 6)
    return stats


def _media() -> EncodedMedia:
    embeds = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    return EncodedMedia(
        embeds=embeds,
        meta=VisualMeta("video", (2, 4, 6), 1.5, 6, (0.25, 1.625)),
        num_frames=4,
        frame_timestamps_s=[0.0, 0.5, 1.25, 2.0],
        decode_ms=12.5,
        encode_ms=30.25,
        cache_hit=True,
        sha256=hashlib.sha256(b"media").hexdigest(),
        token_index=torch.tensor([0, 2, 3, 7, 8, 11]),
        key_mask=torch.tensor([False, True, False, False, True, False]),
        pruning=_stats(),
        deepstack=[
            torch.randn(6, 8, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in (2, 3)
        ],
    )


def _handle() -> PrefillHandle:
    return PrefillHandle(
        first_token_id=42,
        num_prompt_tokens=90,
        num_cached_tokens=70,
        next_position_ids=[40, 3, 5, 7],
        kv_num_bytes=7000,
        prefill_ms=8.5,
        num_visual_tokens_in=60,
        num_visual_tokens_out=40,
        kv_num_bytes_uncompressed=9000,
        pruning=_stats(),
        visual_entry_mask=torch.rand(2, 1, 70, generator=torch.Generator().manual_seed(1)) > 0.5,
        kept_visual_token_index=[1, 4, 9],
        num_reused_prompt_tokens=50,
        num_stored_prompt_tokens=40,
        first_text=" a",
        distinct_prompt_token_ids=[3, 17, 151643],
        prompt_ends_reasoning=True,
        max_new_tokens=12,
        other_choices=[ChoiceStart(43, " b"), ChoiceStart(44, None)],
        kv_handle="abc123",
        kv_address="prefill-0:50052",
        first_logprob=_logprob(42),
        prompt_logprobs=[dataclasses.replace(_logprob(3), rank=12), _logprob(4)],
        prompt_token_ids=[151644 - i for i in range(90)],  # num_prompt_tokens of them
    )


def _logprob(token_id: int) -> TokenLogprob:
    """A token's logprob with float32 values (what the engines compute; -inf: a masked logit):
    they must come back from the wire bit for bit."""
    value = torch.tensor(-1.2345678, dtype=torch.float32).item()
    return TokenLogprob(
        token_id,
        "é",
        value,
        (TopLogprob(7, " a", -0.25), TopLogprob(token_id, "é", value), TopLogprob(9, "", -math.inf)),
    )


def _assert_all_set(obj: Any, skip: tuple[str, ...] = ()) -> None:
    """Every dataclass field of `obj` differs from its default: the sample exercises them all."""
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if default is None:
            assert value is not None, f"the sample leaves {f.name} at its default"
        else:
            assert value != default, f"the sample leaves {f.name} at its default"


def _assert_same(a: Any, b: Any, skip: tuple[str, ...] = ()) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        if f.name in skip:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):  # EncodedMedia.deepstack
            assert len(x) == len(y) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(x, y)), (
                f.name
            )
        else:
            assert x == y, f.name


def test_the_samples_set_every_field():
    _assert_all_set(_media())
    _assert_all_set(_handle())
    _assert_all_set(_stats())


def test_encoded_media_round_trips_through_its_record_and_the_proto():
    media = _media()
    record = media.to_record()
    assert set(record.fields) == set(encoder_pb2.EncodeResult.DESCRIPTOR.fields_by_name), (
        "the record is keyed like the wire's EncodeResult"
    )
    # transfer_bytes is the gateway's own count, carried in its AskSummary only: it never crosses
    # a stage boundary (nor goes into the token cache).
    assert set(record.fields["pruning"]) == set(common_pb2.PruningReport.DESCRIPTOR.fields_by_name) - {
        "transfer_bytes"
    }
    _assert_same(EncodedMedia.from_record(record), media, skip=("pruning",))
    msg = convert.encode_result_to_proto(media)
    wire = TensorAssembler(1 << 20)  # every tensor (embeddings, DeepStack features) as chunks
    num_bytes_sent = 0
    for chunk in convert.encoded_media_chunks(media):
        num_bytes_sent += len(chunk.data)
        wire.add(common_pb2.TensorChunk.FromString(chunk.SerializeToString()))
    # What the gateway counts of this hop in the request's transfer_bytes: all of the tensors' bytes.
    assert convert.encoded_media_num_bytes(media) == num_bytes_sent == wire.total_bytes == 3 * 6 * 8 * 2
    back = convert.encoded_media_from_proto(
        encoder_pb2.EncodeResult.FromString(msg.SerializeToString()), wire.tensors()
    )
    _assert_same(back, media, skip=("pruning",))
    _assert_same(back.pruning, media.pruning, skip=("transfer_bytes",))
    _assert_same(EncodedMedia.from_record(record).pruning, media.pruning, skip=("transfer_bytes",))


def test_encoded_media_without_pruning_round_trips_as_none():
    media = dataclasses.replace(_media(), token_index=None, key_mask=None, pruning=PruningStats())
    back = convert.encoded_media_from_proto(convert.encode_result_to_proto(media), media.to_record().tensors)
    assert back.token_index is None and back.key_mask is None and back.pruning == PruningStats()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"modality": "audio"}, "modality 'video' or 'image'"),
        ({"grid_thw": [1, 2]}, "3-value grid_thw"),
        ({"grid_thw": [0, 2, 2]}, "3-value grid_thw"),
        ({"key_token_index": [6]}, "key_token_index points outside"),
        ({"key_token_index": [-1]}, "key_token_index points outside"),
        ({"num_deepstack_features": 3}, "names 3 DeepStack features but 2 were sent"),
        ({"num_deepstack_features": -1}, "names -1 DeepStack features"),
    ],
)
def test_a_malformed_encode_result_is_an_invalid_request(change, match):
    fields = {**_media().to_record().fields, **change}
    msg = encoder_pb2.EncodeResult(**fields)
    with pytest.raises(InvalidRequest, match=match):
        convert.encoded_media_from_proto(msg, _media().to_record().tensors)


@pytest.mark.parametrize("disk", [False, True])
def test_the_token_cache_stores_encoded_media_whole(tmp_path, disk):
    media = _media()
    key = make_cache_key(media.sha256, {"x": 1})
    config = TokenCacheConfig(disk_dir=str(tmp_path) if disk else None)
    cache = TokenCache(config)
    cache.put(key, media)
    if disk:
        cache = TokenCache(config)  # a restart: the memory tier is empty
    hit = cache.get(key)
    assert hit is not None and cache.stats().num_disk_hits == int(disk)
    _assert_same(hit, media, skip=("pruning",))
    _assert_same(hit.pruning, media.pruning, skip=("transfer_bytes",))
    assert hit is not cache.get(key), "each hit is a fresh object"


def _prefill_responses(handle: PrefillHandle) -> list[prefill_pb2.PrefillResponse]:
    async def collect() -> list[prefill_pb2.PrefillResponse]:
        return [response async for response in convert.prefill_responses(handle)]

    return asyncio.run(collect())


def _prefill_answer(handle: PrefillHandle) -> convert.PrefillAnswer:
    """Prefill's answer for `handle` as the gateway reads it, each message through its bytes."""

    async def read() -> convert.PrefillAnswer:
        answer = convert.PrefillAnswer()
        async for response in convert.prefill_responses(handle):
            await answer.add(prefill_pb2.PrefillResponse.FromString(response.SerializeToString()))
        return answer

    return asyncio.run(read())


def test_prefill_handle_round_trips_through_the_proto():
    handle = _handle()
    handle.prompt_logprobs = [
        dataclasses.replace(_logprob(i), rank=i + 1) for i in range(handle.num_prompt_tokens)
    ]
    assert {f.name for f in dataclasses.fields(PrefillHandle)} == {
        *prefill_pb2.PrefillResult.DESCRIPTOR.fields_by_name,
        "prompt_logprobs",
    }, (
        "PrefillHandle and PrefillResult name the same fields (the prompt's logprobs come before it, in pieces)"
    )
    back = _prefill_answer(handle).handle()
    # The mask crosses the wire flat; the decoder shapes it by its cache.
    assert back.visual_entry_mask is not None
    assert torch.equal(back.visual_entry_mask, handle.visual_entry_mask.flatten())
    _assert_same(back, handle, skip=("pruning", "visual_entry_mask"))
    _assert_same(back.pruning, handle.pruning, skip=("transfer_bytes",))
    # The first token's text: "" (held back, e.g. half a UTF-8 character) is not "unset" (None:
    # the token ends the request, the decoder sends it).
    for text in ("", None):
        msg = convert.handle_to_proto(dataclasses.replace(handle, first_text=text))
        assert (
            convert.handle_from_proto(
                prefill_pb2.PrefillResult.FromString(msg.SerializeToString())
            ).first_text
            == text
        )


def test_prefills_prompt_token_ids_come_back_only_when_sent_and_whole():
    """The prompt's ids (asked by return_prompt_token_ids) cross in the result; none sent is None
    (a prompt is never empty), and a count other than the prompt's tokens is prefill's fault."""
    handle = dataclasses.replace(_handle(), prompt_logprobs=None)
    assert handle.prompt_token_ids is not None
    assert _prefill_answer(handle).handle().prompt_token_ids == handle.prompt_token_ids
    assert (
        _prefill_answer(dataclasses.replace(handle, prompt_token_ids=None)).handle().prompt_token_ids is None
    )
    short = dataclasses.replace(handle, prompt_token_ids=handle.prompt_token_ids[:-1])
    with pytest.raises(RuntimeError, match="89 prompt token ids for a 90-token prompt"):
        _prefill_answer(short).handle()
    # A decoder never gets them, nor the prompt's logprobs: the gateway's to send.
    assert handle.for_choice(0).prompt_token_ids is None and handle.for_choice(1).prompt_token_ids is None


def test_a_long_prompts_logprobs_cross_in_pieces_under_the_message_limit():
    """10,000 prompt tokens with 20 top tokens each: over 4 MiB, which one message cannot carry
    (prefill refused such a request before it ran). They go in pieces of at most
    PROMPT_LOGPROBS_PIECE_BYTES and come back whole, in order, bit for bit."""
    from epd.stages.server_config import MAX_MESSAGE_BYTES
    from epd.transport.message_convert import PROMPT_LOGPROBS_PIECE_BYTES

    top = tuple(TopLogprob(100_000 + t, f"token{t:04d}", -0.5 - t) for t in range(20))
    num_tokens = 10_000
    logprobs = [
        TokenLogprob(100_000 + i, f"prompt{i:05d}", -1.25 - i, top, rank=1 + i) for i in range(num_tokens)
    ]
    handle = dataclasses.replace(
        _handle(), num_prompt_tokens=num_tokens, prompt_logprobs=logprobs, prompt_token_ids=None
    )
    responses = _prefill_responses(handle)
    pieces = [r for r in responses if r.WhichOneof("kind") == "prompt_logprobs"]
    assert responses[-1].WhichOneof("kind") == "result" and responses[:-1] == pieces
    assert sum(r.ByteSize() for r in pieces) > MAX_MESSAGE_BYTES
    assert all(r.ByteSize() <= PROMPT_LOGPROBS_PIECE_BYTES + 16 for r in pieces), [
        r.ByteSize() for r in pieces
    ]
    assert _prefill_answer(handle).handle().prompt_logprobs == logprobs
    assert list(convert.prompt_logprobs_pieces([])) == []


def test_joined_prompt_logprobs_are_not_objects_the_garbage_collector_walks():
    """The gateway holds up to half a million entries a request; as as many Python objects, each
    full garbage collection walked them all holding the GIL (0.3 to 0.75 s of every other stream's
    time). Joined, they are the pieces' messages: a few objects the collector tracks, whatever
    the count, each entry read back whole, in order, by index and slice, across pieces."""
    from epd.transport.message_convert import PROMPT_LOGPROBS_PIECE_BYTES

    num_tokens = 50_000
    logprobs = [
        TokenLogprob(
            i, f"prompt{i:05d}", -1.25 - i, (TopLogprob(7, " a", -0.5), TopLogprob(i, "é", -2.0)), 1 + i
        )
        for i in range(num_tokens)
    ]
    handle = dataclasses.replace(
        _handle(), num_prompt_tokens=num_tokens, prompt_logprobs=logprobs, prompt_token_ids=None
    )
    wire = [r.SerializeToString() for r in _prefill_responses(handle)]
    assert len(wire) > 3 and sum(map(len, wire)) > 2 * PROMPT_LOGPROBS_PIECE_BYTES  # pieces and the result

    async def join() -> convert.PrefillAnswer:
        answer = convert.PrefillAnswer()
        for data in wire:
            await answer.add(prefill_pb2.PrefillResponse.FromString(data))
        return answer

    gc.collect()
    tracked_before = len(gc.get_objects())
    joined = asyncio.run(join()).handle().prompt_logprobs
    gc.collect()
    tracked = len(gc.get_objects()) - tracked_before
    assert tracked < num_tokens // 20, f"{tracked} more objects for the garbage collector to walk"
    assert joined is not None and len(joined) == num_tokens
    for i in (0, 1, num_tokens // 3, num_tokens // 2, num_tokens - 1, -1, -num_tokens):
        assert joined[i] == logprobs[i]
    assert joined[19_990:20_010] == logprobs[19_990:20_010] and joined[-2:] == logprobs[-2:]
    assert joined == logprobs and list(joined) == logprobs and joined != logprobs[1:]
    with pytest.raises(IndexError):
        joined[num_tokens]


def test_prefill_answers_prompt_logprobs_are_checked_as_they_arrive(monkeypatch):
    """The gateway holds the list: past MAX_PROMPT_LOGPROB_ENTRIES it stops reading (prefill refuses
    such a request before it runs); one per prompt token, and the result must come. A malformed
    answer is prefill's fault: INTERNAL (500), its detail in the log, not a 400, nor the 413 that
    prefill's own up-front refusal of such a request is (the client's to change)."""
    handle = _handle()
    handle.prompt_logprobs = [_logprob(i) for i in range(handle.num_prompt_tokens)]  # 4 entries each
    monkeypatch.setattr(convert, "MAX_PROMPT_LOGPROB_ENTRIES", 4 * handle.num_prompt_tokens - 1)
    with pytest.raises(RuntimeError, match="malformed: more than 359 prompt logprob entries") as too_many:
        _prefill_answer(handle)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="prefill sent 89 prompt logprobs for a 90-token prompt") as wrong:
        _prefill_answer(dataclasses.replace(handle, prompt_logprobs=handle.prompt_logprobs[1:])).handle()
    with pytest.raises(RuntimeError, match="ended without its result") as missing:
        convert.PrefillAnswer().handle()
    broken = convert.PrefillAnswer()
    broken.result = prefill_pb2.PrefillResult()  # no kv_handle, no positions
    with pytest.raises(RuntimeError, match="prefill's answer is malformed: prefill result must carry") as bad:
        broken.handle()
    for caught in (too_many, wrong, missing, bad):
        assert status_of(caught.value)[0] == grpc.StatusCode.INTERNAL


def test_pruning_stats_and_token_steps_round_trip_through_the_proto():
    stats = _stats()
    _assert_same(convert.stats_from_proto(convert.stats_to_proto(stats)), stats, skip=("transfer_bytes",))
    step = TokenStep(
        [5, 6],
        "ab",
        "stop",
        kv_transfer_ms=3.5,
        kv_num_bytes=1024,
        decode_evict=(40, 30),
        stop_reason="\n",
        logprobs=[_logprob(5), _logprob(6)],
    )
    # `index` (the choice) is the gateway's: a decode stream is one choice and does not carry it
    _assert_all_set(step, skip=("index",))
    _assert_same(convert.token_step_from_proto(convert.token_step_to_proto(step)), step)
    # vLLM's stop_reason is a stop string, a stop token id (an int, not a string), or None.
    for stop_reason in (151643, None):
        step = dataclasses.replace(step, stop_reason=stop_reason)
        _assert_same(convert.token_step_from_proto(convert.token_step_to_proto(step)), step)


def _every_knob_off_default() -> PruningConfig:
    return PruningConfig(
        temporal_drop=True,
        temporal_threshold=0.07,
        temporal_before_tower=False,
        spatial_merge=True,
        spatial_merge_threshold=0.8,
        spatial_merge_window=3,
        key_token_ratio=0.1,
        key_token_score="norm",
        prefill_drop=True,
        prefill_drop_layer=3,
        prefill_drop_layers=(1, 3),
        prefill_keep_ratio=0.5,
        prefill_keep_count=17,
        prefill_keep_basis="video",
        prefill_query_window=5,
        kv_compress=True,
        kv_keep_ratio=0.6,
        kv_budget_bytes=1 << 20,
        kv_merge="pivotal",
        kv_query_window=4,
        kv_dtype="float16",
        decode_evict=True,
        decode_keep_ratio=0.7,
        decode_ema_decay=0.5,
        decode_min_steps=2,
        decode_evict_interval=3,
    )


def test_every_pruning_knob_parses_from_its_text_by_its_declared_type():
    cfg = _every_knob_off_default()
    _assert_all_set(cfg)
    knobs = cfg.to_knobs()
    assert set(knobs) == {f.name for f in dataclasses.fields(PruningConfig)}
    assert PruningConfig.from_knobs(knobs) == cfg
    assert convert.pruning_from_proto(convert.pruning_to_proto(cfg)) == cfg
    assert PruningConfig().to_knobs() == {}
    parsed = PruningConfig.from_knobs(
        {"prefill_keep_count": "none", "decode_evict": "1", "kv_merge": "none"}, "balanced"
    )
    assert (parsed.prefill_keep_count, parsed.decode_evict, parsed.kv_merge) == (None, True, "none")
    assert parsed.kv_compress, "the preset's other knobs stay"


@pytest.mark.parametrize(
    "knobs,match",
    [
        ({"decode_evict": "yes"}, r"pruning option decode_evict='yes' is not a valid bool$"),
        ({"kv_budget_bytes": "lots"}, r"kv_budget_bytes='lots' is not a valid int \| None \(integers within"),
        ({"prefill_drop_layers": "1,x"}, r"is not a valid tuple\[int, \.\.\.\]"),
        ({"kv_keep_ratio": "nan"}, "kv_keep_ratio='nan' is not a valid float"),
        ({"bogus": "1"}, r"unknown pruning option 'bogus'; known options: \["),
        ({"kv_merge": "median"}, "kv_merge must be one of"),
    ],
)
def test_bad_knobs_name_the_knob_and_the_type(knobs, match):
    with pytest.raises(ValueError, match=match):
        PruningConfig.from_knobs(knobs)
    with pytest.raises(InvalidRequest, match=match):
        convert.pruning_from_proto(common_pb2.PruningOptions(knobs=knobs))


def test_generation_limits_are_checked_in_one_place():
    check_generation_limits(GenerationConfig(max_new_tokens=8), 8)
    with pytest.raises(
        InvalidRequest,
        match="max_new_tokens must be between 1 and 8 .the OpenAI API.s max_tokens or max_completion_tokens., got 9",
    ):
        check_generation_limits(GenerationConfig(max_new_tokens=9), 8)
    with pytest.raises(InvalidRequest, match="top_p must be in"):
        check_generation_limits(GenerationConfig(max_new_tokens=8, top_p=0.0), 8)


def test_decode_refuses_over_limit_generation_before_any_cache_moves():
    """The limits check comes before the KV cache is taken, whatever the cache's source: the
    in-process store keeps it (for the pipeline to release), and no pull starts."""
    from epd.decode_svc.config import DecodeConfig

    k = torch.zeros(1, 2, 3, 4)
    store = KvStore(max_bytes=10_000, ttl_s=10)
    handle = dataclasses.replace(_handle(), kv_handle=store.put(KvCache([k], [k.clone()])))
    pulls: list[PrefillHandle] = []

    async def take_kv(h: PrefillHandle) -> KvCache:
        pulls.append(h)
        raise AssertionError("no cache may move for a refused request")

    thread = ModelThread()
    limits = DecodeConfig(max_new_tokens_limit=16)
    too_many = GenerationConfig(max_new_tokens=17)

    async def first_step(stage: LocalDecodeStage) -> None:
        async for _ in stage.generate(handle, too_many, "r"):
            break

    try:
        for source in (take_from_store(store), take_kv):
            # the refusal comes before any model call
            no_model = SimpleNamespace(kv_bytes_per_token=1024, decode_state_bytes=0, vocab_size=None)
            stage = LocalDecodeStage(DecodeEngine(no_model), source, thread, limits)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="max_new_tokens must be between 1 and 16"):
                asyncio.run(first_step(stage))
    finally:
        thread.close()
    assert len(store) == 1 and pulls == []


def test_a_record_missing_its_embeddings_or_a_field_is_refused():
    record = _media().to_record()
    with pytest.raises(KeyError):
        EncodedMedia.from_record(MediaRecord({}, record.fields))
    fields = dict(record.fields)
    del fields["num_frames"]
    with pytest.raises(KeyError):
        EncodedMedia.from_record(MediaRecord(record.tensors, fields))
