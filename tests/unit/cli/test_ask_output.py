"""`epd ask` and `epd bench serve` read the SDK's typed result, never protos: the embedded mode
turns the pipeline's summary into the same `AskResult` the remote mode gets, so --json prints
one shape (the HTTP API's `epd` names) in both modes."""

from __future__ import annotations

import ast
from pathlib import Path

from epd.cli.ask import _result_of
from epd.client import Stage, StageEvent
from epd.client.types import result_from_proto
from epd.gateway.pipeline import AskSummary
from epd.gateway.servicer import summary_to_proto
from epd.stages.names import TIMING_NAMES
from epd.token_pruning import PruningStats

ROOT = Path(__file__).resolve().parents[3]


def _summary() -> AskSummary:
    stats = PruningStats(num_key_tokens=1, prefill_flops_full=9, prefill_flops_pruned=5, kv_bytes_before=4,
                         kv_bytes_after=2)  # fmt: skip
    stats.record("kv_compress", 24, 12)
    return AskSummary(
        request_id="q", answer="blue", token_ids=[4, 5], finish_reason="length", num_frames=2, num_visual_tokens=24,
        num_prompt_tokens=40, timings_ms={name: float(i) for i, name in enumerate(TIMING_NAMES)}, kv_num_bytes=7,
        encoder_cache_hit=False, media_sha256="ef" * 32, frame_timestamps_s=[0.0, 0.5], pruning=stats,
        grid_thw=(1, 4, 6), kept_visual_token_index=[1, 2],
    )  # fmt: skip


def test_embedded_and_remote_results_print_the_same_json():
    summary = _summary()
    events = [StageEvent(Stage.ENCODE, "finished", 3.0, 2.0, {})]
    embedded = _result_of(summary, events).to_dict()
    remote = result_from_proto(summary_to_proto(summary), events).to_dict()
    assert embedded == remote
    assert embedded["timings_ms"]["video_decode"] == embedded["timings_ms"]["decode"] == 0.0
    assert embedded["pruning"]["stages"] == [{"stage": "kv_compress", "num_visual_tokens_in": 24,
                                              "num_visual_tokens_out": 12}]  # fmt: skip
    assert embedded["events"] == [{"stage": "encode", "state": "finished", "at_ms": 3.0, "duration_ms": 2.0,
                                   "details": {}}]  # fmt: skip


def _imports_and_calls(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imports |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    calls = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return imports, calls


def test_the_cli_and_the_serving_benchmark_use_no_protos():
    for rel, allowed in (
        ("epd/cli/ask.py", {"epd.transport.errors"}),  # the embedded mode names its own errors
        ("epd/cli/configs.py", set()),
        ("bench/serve.py", set()),
    ):
        imports, calls = _imports_and_calls(ROOT / rel)
        wire = {m for m in imports if m.startswith(("epd.v1", "epd.transport")) or "_pb2" in m} - allowed
        assert wire == set(), f"{rel} imports {wire}"
        assert not calls & {"WhichOneof", "ask_stream", "HasField"}, f"{rel} reads protos: {calls}"
