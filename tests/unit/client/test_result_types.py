"""The SDK's result carries every field the server sends, typed, with no protobuf in it; old
servers' names ("decode") are understood; the 0.1 forms still work, deprecated."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
from google.protobuf.message import Message

from epd.client import AskResult, GridTHW, PruningReport, PruningStageCount, Stage, StageEvent, Timings
from epd.client.types import TokenLogprob, result_from_proto, stage_event_from_proto
from epd.gateway import ask_types
from epd.gateway.servicer import summary_to_proto
from epd.gateway.summary_fields import epd_details
from epd.stages.names import TIMING_NAMES
from epd.token_pruning import PruningStats
from epd.transport.message_convert import logprob_from_proto
from epd.v1 import common_pb2, gateway_pb2


def full_summary() -> gateway_pb2.AskSummary:
    """An AskSummary with every field set to something other than its default."""
    summary = gateway_pb2.AskSummary(
        request_id="r-1",
        answer="a red circle",
        token_ids=[5, 6, 7],
        finish_reason="length",
        num_frames=4,
        num_visual_tokens=48,
        num_prompt_tokens=70,
        timings_ms={"video_decode": 1.5, "decode": 1.5, "encode": 2.0, "prefill": 3.0, "kv_transfer": 0.5,
                    "generate": 4.0, "ttft": 6.0, "total": 11.0},
        kv_num_bytes=4096,
        encoder_cache_hit=True,
        media_sha256="ab" * 32,
        frame_timestamps_s=[0.0, 0.5, 1.0, 1.5],
        pruning=common_pb2.PruningReport(
            stages=[common_pb2.PruningStageCount(stage="prefill_drop", num_visual_tokens_in=48,
                                                 num_visual_tokens_out=24)],
            num_key_tokens=3, prefill_flops_full=1000, prefill_flops_pruned=600, kv_bytes_before=8192,
            kv_bytes_after=4096, transfer_bytes=45056,
        ),
        grid_thw=[2, 8, 12],
        kept_visual_token_index=[0, 2, 5],
        num_reused_prompt_tokens=7,
        stop_string="\n",
        logprobs=[common_pb2.TokenLogprob(token_id=5, token="a", logprob=-0.5, top_logprobs=[
            common_pb2.TokenLogprob(token_id=5, token="a", logprob=-0.5)])],
        prompt_token_ids=[151644, 872, 198],
    )  # fmt: skip
    return summary


def prompt_logprobs() -> list[TokenLogprob]:
    """What the `AskResponse.prompt_logprobs` pieces before the summary carried, joined."""
    return [logprob_from_proto(lp) for lp in (
        common_pb2.TokenLogprob(token_id=3, token="q", logprob=math.nan),
        common_pb2.TokenLogprob(token_id=4, token="r", logprob=-2.0, rank=3, top_logprobs=[
            common_pb2.TokenLogprob(token_id=5, token="a", logprob=-0.25)]),
    )]  # fmt: skip


def _unset_fields(msg: Message) -> list[str]:
    """Fields left at their defaults; a oneof's members count as set when one of them is."""
    set_names = {f.name for f, _ in msg.ListFields()}
    return [
        f.name
        for f in msg.DESCRIPTOR.fields
        if f.name not in set_names and not (f.containing_oneof and msg.WhichOneof(f.containing_oneof.name))
    ]


def _wire_names(descriptor) -> set[str]:
    """A message's field names, a oneof's members under the oneof's name (`stop_reason`: the
    result has one field, a str or an int)."""
    return {f.containing_oneof.name if f.containing_oneof else f.name for f in descriptor.fields}


def test_the_fixture_sets_every_field_of_the_wire_summary():
    # A field added to AskSummary must be added here, and then to AskResult (next test).
    summary = full_summary()
    assert _unset_fields(summary) == []
    assert _unset_fields(summary.pruning) == [] and _unset_fields(summary.pruning.stages[0]) == []


def test_the_result_has_a_field_for_every_field_the_server_sends():
    result_fields = {f.name for f in dataclasses.fields(AskResult)}
    assert _wire_names(gateway_pb2.AskSummary.DESCRIPTOR) <= result_fields
    assert {f.name for f in common_pb2.PruningReport.DESCRIPTOR.fields} <= {
        f.name for f in dataclasses.fields(PruningReport)
    }
    assert {f.name for f in common_pb2.PruningStageCount.DESCRIPTOR.fields} <= {
        f.name for f in dataclasses.fields(PruningStageCount)
    }
    assert {f.name for f in common_pb2.StageEvent.DESCRIPTOR.fields} <= {
        f.name for f in dataclasses.fields(StageEvent)
    }


def test_every_value_of_the_summary_arrives_typed():
    summary = full_summary()
    event = common_pb2.StageEvent(stage="prefill", state="finished", at_ms=9.0, duration_ms=3.0,
                                  details={"num_prompt_tokens": "70"})  # fmt: skip
    result = result_from_proto(summary, [stage_event_from_proto(event)], prompt_logprobs())
    out = result.to_dict()
    for field in gateway_pb2.AskSummary.DESCRIPTOR.fields:
        if field.name in ("pruning", "timings_ms", "logprobs"):
            continue
        if field.containing_oneof:  # the member that is set, under the oneof's name
            if summary.WhichOneof(field.containing_oneof.name) == field.name:
                assert out[field.containing_oneof.name] == getattr(summary, field.name), field.name
            continue
        wire = getattr(summary, field.name)
        wire = wire if isinstance(wire, (str, int, float, bool)) else list(wire)
        assert out[field.name] == wire, field.name
    assert result.timings_ms == Timings(1.5, 2.0, 3.0, 0.5, 4.0, 6.0, 11.0)
    assert out["timings_ms"] == dict(summary.timings_ms)
    assert result.pruning == PruningReport(
        (PruningStageCount("prefill_drop", 48, 24),), 3, 1000, 600, 8192, 4096, 45056
    )
    assert result.pruning.prefill_flops_saved == 400
    assert result.grid_thw == GridTHW(temporal=2, height=8, width=12)
    assert out["logprobs"] == [
        {
            "token_id": 5,
            "token": "a",
            "logprob": -0.5,
            "top": [{"token_id": 5, "token": "a", "logprob": -0.5}],
        }
    ]
    assert out["prompt_logprobs"] == [
        None,
        {
            "token_id": 4,
            "token": "r",
            "logprob": -2.0,
            "top": [{"token_id": 5, "token": "a", "logprob": -0.25}],
            "rank": 3,
        },
    ]
    assert result.prompt_logprobs is not None and result.prompt_logprobs[1].rank == 3
    assert result.events == [StageEvent(Stage.PREFILL, "finished", 9.0, 3.0, {"num_prompt_tokens": "70"})]
    json.dumps(out)  # JSON-able as it is


def test_no_protobuf_anywhere_in_the_result():
    event = stage_event_from_proto(common_pb2.StageEvent(stage="encode", state="started"))
    result = result_from_proto(full_summary(), [event], prompt_logprobs())

    def walk(value, where: str) -> None:
        assert not isinstance(value, Message), where
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{where}.{f.name}")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    walk(result, "result")


def test_an_older_servers_names_are_understood():
    old = gateway_pb2.AskSummary(timings_ms={"decode": 7.0, "encode": 2.0, "ttft": 9.0})
    result = result_from_proto(old, [])
    assert result.timings_ms.video_decode_ms == 7.0 and result.timings_ms.encode_ms == 2.0
    assert result.grid_thw == GridTHW(0, 0, 0)  # an old server sends no grid
    event = stage_event_from_proto(common_pb2.StageEvent(stage="decode", state="started"))
    assert event.stage is Stage.VIDEO_DECODE
    # A newer server's stage or timing this SDK does not know is kept, not an error.
    assert stage_event_from_proto(common_pb2.StageEvent(stage="think", state="started")).stage == "think"
    assert Timings.from_wire({"think": 3.0}).extra_ms == {"think": 3.0}


def test_the_0_1_forms_still_work_and_warn():
    result = result_from_proto(
        full_summary(), [stage_event_from_proto(common_pb2.StageEvent(stage="encode"))]
    )
    with pytest.warns(DeprecationWarning, match="timings_ms.ttft_ms"):
        assert result.timings_ms["ttft"] == 6.0
    with pytest.warns(DeprecationWarning):
        assert result.timings_ms["decode"] == result.timings_ms.video_decode_ms == 1.5
    assert {"decode", "video_decode", "encode", "prefill", "kv_transfer", "ttft", "total"} <= set(
        result.timings_ms
    )
    with pytest.warns(DeprecationWarning):
        assert result.timings_ms.get("nope", -1.0) == -1.0
    with pytest.warns(DeprecationWarning, match="event_protos"):
        protos = result.event_protos
    assert isinstance(protos[0], common_pb2.StageEvent) and protos[0].stage == "encode"
    # A 0.1 caller that builds a result with a dict of timings gets the typed form.
    built = AskResult("a", [1], "stop", 1, 2, 3, {"decode": 4.0, "ttft": 5.0}, 0, False, "")
    assert built.timings_ms.video_decode_ms == 4.0 and built.timings_ms.ttft_ms == 5.0


def test_timings_have_one_field_per_timing_name():
    names = {f.name for f in dataclasses.fields(Timings)}
    assert names == {f"{name}_ms" for name in TIMING_NAMES} | {"extra_ms"}


def test_the_sdk_and_the_stage_names_import_no_torch():
    code = (
        "import sys, epd.client, epd.stages.names, epd.stages\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_to_dict_has_every_name_and_value_of_the_http_apis_epd_object():
    """The same summary, through the gRPC answer into the SDK and through the HTTP API's `epd`
    object, gives the same value under each of the HTTP object's names (`pruning.transfer_bytes`
    was missing from the SDK's, then 0 there: the gRPC summary did not carry it)."""
    stats = PruningStats(num_key_tokens=3, prefill_flops_full=1000, prefill_flops_pruned=600,
                         kv_bytes_before=8192, kv_bytes_after=4096, transfer_bytes=45056)  # fmt: skip
    stats.record("prefill_drop", 48, 24)
    summary = ask_types.AskSummary(
        request_id="r-1", answer="a red circle", token_ids=[5, 6, 7], finish_reason="length", num_frames=4,
        num_visual_tokens=48, num_prompt_tokens=70,
        timings_ms={"video_decode": 1.5, "encode": 2.0, "prefill": 3.0, "kv_transfer": 0.5, "generate": 4.0,
                    "ttft": 6.0, "total": 11.0},
        kv_num_bytes=4096, encoder_cache_hit=True, media_sha256="ab" * 32, frame_timestamps_s=[0.0, 0.5, 1.0, 1.5],
        pruning=stats, grid_thw=(2, 8, 12), kept_visual_token_index=[0, 2, 5], num_reused_prompt_tokens=7,
    )  # fmt: skip
    http = epd_details(summary)
    del http["kept_tokens"]  # the web demo's grid, drawn from kept_visual_token_index
    sdk = result_from_proto(summary_to_proto(summary), []).to_dict()
    assert set(http["pruning"]) == set(sdk["pruning"])
    assert set(http) <= set(sdk)
    assert {name: sdk[name] for name in http} == json.loads(json.dumps(http))
