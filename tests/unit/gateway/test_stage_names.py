"""`epd.stages.names.Stage` is the one list of stage names: every StageEvent in the code is built
from it, the web demo's timeline, the proto docs and the JSON of both APIs use its names, and the
renamed timing ("decode" -> "video_decode") goes out under both names until 0.3."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from epd.client import Stage
from epd.client.types import result_from_proto
from epd.gateway.ask_types import AskSummary
from epd.gateway.servicer import summary_to_proto
from epd.gateway.summary_fields import epd_details
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.stages.names import TIMED_STAGES, TIMING_NAMES, timings_from_either, timings_with_legacy_names
from epd.token_pruning import PruningStats
from epd.transport import convert
from epd.v1 import gateway_pb2

ROOT = Path(__file__).resolve().parents[3]
STATIC = ROOT / "epd" / "gateway" / "web" / "static"


def _python_files() -> list[Path]:
    top = ["epd", "encoder_svc", "prefill_svc", "decode_svc", "bench", "video", "token_pruning"]
    return sorted(p for d in top for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name and p.is_file())


def test_every_stage_event_in_the_code_names_a_stage_from_the_enum():
    literal = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "StageEvent"
            ):
                first = (
                    node.args[0]
                    if node.args
                    else next((k.value for k in node.keywords if k.arg == "stage"), None)
                )
                if isinstance(first, ast.Constant):
                    literal.append(f"{path.relative_to(ROOT)}:{node.lineno}: {first.value!r}")
    assert literal == [], "name stages with epd.stages.names.Stage, not a string: " + "; ".join(literal)


def test_the_web_demos_timeline_lists_the_timed_stages():
    match = re.search(r"const STAGES = \[([^\]]*)\];", (STATIC / "app.js").read_text())
    assert match, "app.js has no STAGES list"
    assert re.findall(r'"([^"]+)"', match.group(1)) == [s.value for s in TIMED_STAGES]


def test_the_proto_docs_list_the_enum():
    common = (ROOT / "protos/epd/v1/common.proto").read_text()
    comment = re.search(r"message StageEvent \{\n((?:\s*//.*\n)+)\s*string stage = 1;", common)
    assert comment, "the stage field of StageEvent lost its comment"
    names = re.findall(r'"([a-z_]+)"', comment.group(1).split("Servers before")[0])
    assert names == [s.value for s in Stage]
    gateway = (ROOT / "protos/epd/v1/gateway.proto").read_text()
    comment = re.search(r"((?:\s*//.*\n)+)\s*map<string, double> timings_ms", gateway)
    assert comment and re.findall(r'"([a-z_]+)"', comment.group(1).split("until 0.3")[0]) == list(
        TIMING_NAMES
    )


def test_stage_names_print_as_themselves():
    assert [str(s) for s in Stage] == [f"{s}" for s in Stage] == [s.value for s in Stage]
    assert Stage.of("decode") is Stage.VIDEO_DECODE and Stage.of("generate") is Stage.GENERATE


def test_a_renamed_timing_goes_out_under_both_names_and_comes_back_under_the_new_one():
    sent = timings_with_legacy_names({"video_decode": 3.0, "ttft": 4.0})
    assert sent == {"video_decode": 3.0, "decode": 3.0, "ttft": 4.0}
    assert (
        timings_from_either(sent)
        == timings_from_either({"decode": 3.0, "ttft": 4.0})
        == {
            "video_decode": 3.0,
            "ttft": 4.0,
        }
    )


def domain_summary() -> AskSummary:
    stats = PruningStats(num_key_tokens=2, prefill_flops_full=10, prefill_flops_pruned=6, kv_bytes_before=8,
                         kv_bytes_after=4)  # fmt: skip
    stats.record("prefill_drop", 48, 24)
    return AskSummary(
        request_id="r", answer="a", token_ids=[1, 2], finish_reason="stop", num_frames=4, num_visual_tokens=48,
        num_prompt_tokens=60, timings_ms={name: 1.0 + i for i, name in enumerate(TIMING_NAMES)},
        kv_num_bytes=9, encoder_cache_hit=True, media_sha256="cd" * 32, frame_timestamps_s=[0.0, 1.0],
        pruning=stats, grid_thw=(2, 4, 6), kept_visual_token_index=[0, 3], num_reused_prompt_tokens=52,
        stop_reason=151643, logprobs=[TokenLogprob(1, "a", -0.5, (TopLogprob(1, "a", -0.5),)),
                                      TokenLogprob(2, "b", -1.25, (TopLogprob(3, "c", -1.0),))],
        prompt_logprobs=[TokenLogprob(4, "d", -2.5, (TopLogprob(1, "a", -0.75),), rank=9)],
        prompt_token_ids=[151644, 872, 198],
    )  # fmt: skip


def test_the_grpc_summary_carries_every_field_of_the_pipelines_summary():
    wire = summary_to_proto(domain_summary())
    set_names = {f.name for f, _ in wire.ListFields()}
    # Every field, a oneof by the member the summary sets (stop_reason: an int is a stop token id).
    assert set_names == {f.name for f in gateway_pb2.AskSummary.DESCRIPTOR.fields} - {"stop_string"}
    assert result_from_proto(wire, []).stop_reason == 151643
    assert wire.timings_ms["decode"] == wire.timings_ms["video_decode"] == 1.0
    result = result_from_proto(wire, [])
    assert result.grid_thw == (2, 4, 6) and result.kept_visual_token_index == [0, 3]
    assert result.num_reused_prompt_tokens == 52
    assert result.logprobs == domain_summary().logprobs
    assert result.prompt_token_ids == domain_summary().prompt_token_ids
    # The prompt's come before the summary, in pieces (`AskResponse.prompt_logprobs`).
    pieces = list(convert.prompt_logprobs_pieces(domain_summary().prompt_logprobs or ()))
    joined = [convert.logprob_from_proto(lp) for piece in pieces for lp in piece.logprobs]
    assert result_from_proto(wire, [], joined).prompt_logprobs == domain_summary().prompt_logprobs
    assert (
        result.timings_ms.video_decode_ms == 1.0 and result.timings_ms.total_ms == 1.0 + len(TIMING_NAMES) - 1
    )


def test_the_http_epd_object_has_the_sdk_results_names():
    summary = domain_summary()
    http = epd_details(summary)
    sdk = result_from_proto(summary_to_proto(summary), []).to_dict()
    # The answer is OpenAI's message content, the logprobs OpenAI's choice's and the prompt's
    # vLLM's top-level prompt_logprobs (logprobs_protocol), the prompt's ids vLLM's prompt_token_ids
    # (with return_token_ids); events and attempts exist on gRPC only.
    shared = set(sdk) - {
        "answer",
        "logprobs",
        "prompt_logprobs",
        "prompt_token_ids",
        "events",
        "num_attempts",
        "media_num_bytes_sent",
    }
    assert shared <= set(http), shared - set(http)
    for name in shared - {"pruning"}:
        assert http[name] == sdk[name], name
    assert {k: v for k, v in http["pruning"].items() if k in sdk["pruning"]} == sdk["pruning"]
    assert http["timings_ms"]["decode"] == http["timings_ms"]["video_decode"]
