"""`epd ask` and `epd bench serve` read the SDK's typed result, never protos: the embedded mode
turns the pipeline's summary into the same `AskResult` the remote mode gets, so --json prints
one shape (the HTTP API's `epd` names) in both modes."""

from __future__ import annotations

import ast
from pathlib import Path

from epd.cli.ask_embedded import _result_of
from epd.client import Stage, StageEvent
from epd.client.types import result_from_proto
from epd.gateway.ask_types import AskSummary
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
        ("epd/cli/ask_inputs.py", set()),
        ("epd/cli/ask_timeout.py", set()),
        ("epd/cli/ask_output.py", set()),
        ("epd/cli/ask_embedded.py", set()),
        ("epd/cli/ask_remote.py", set()),
        ("epd/cli/configs.py", set()),
        ("bench/serve.py", set()),
        ("bench/serve_requests.py", set()),
        ("bench/serve_report.py", set()),
        ("bench/openai_load.py", set()),
        ("bench/serve_baselines.py", set()),
    ):
        imports, calls = _imports_and_calls(ROOT / rel)
        wire = {m for m in imports if m.startswith(("epd.v1", "epd.transport")) or "_pb2" in m} - allowed
        assert wire == set(), f"{rel} imports {wire}"
        assert not calls & {"WhichOneof", "ask_stream", "HasField"}, f"{rel} reads protos: {calls}"


def test_logprobs_are_printed_after_the_answer_as_a_table_per_token(capsys):
    """`epd ask --logprobs K --prompt-logprobs K`: the answer, then one row per generated token
    (its text, logprob, top alternatives), then one per prompt token (with its rank; the first
    has none); --json prints them in the result's object (`AskResult.to_dict`)."""
    import argparse
    import asyncio
    import json
    import math

    from epd.cli.ask_output import print_turns
    from epd.client import TokenDelta, TokenLogprob, TopLogprob

    summary = _summary()
    summary.logprobs = [
        TokenLogprob(4, "blu", -0.25, (TopLogprob(4, "blu", -0.25), TopLogprob(9, " red", -1.5))),
        TokenLogprob(5, "e\n", -float("inf"), (TopLogprob(7, "ish", -0.125), TopLogprob(5, "e\n", -2.0))),
    ]
    summary.prompt_logprobs = [
        TokenLogprob(1, "<|im_start|>", math.nan),
        TokenLogprob(2, "hi", -3.5, (TopLogprob(8, "ho", -0.5),), rank=4),
    ]

    def printed(json_mode: bool) -> str:
        async def turns():
            async def stream():
                yield TokenDelta([4, 5], "blue")
                yield _result_of(summary, [])

            yield "", stream()

        args = argparse.Namespace(json=json_mode, questions=[], interactive=False)
        asyncio.run(print_turns(args, turns(), ""))
        return capsys.readouterr().out

    lines = printed(False).splitlines()
    assert lines[0] == "blue"
    assert lines[1] == "logprobs of the answer's tokens (2; top 2 at each position):"
    assert lines[2].split() == ["#", "token", "logprob", "top"]
    assert lines[3].split() == ["0", "'blu'", "-0.2500", "'blu'", "-0.2500", "'", "red'", "-1.5000"]
    assert lines[4].split() == ["1", "'e\\n'", "-inf", "'ish'", "-0.1250", "'e\\n'", "-2.0000"]
    assert lines[5] == "logprobs of the prompt's tokens (2; top 1 at each position):"
    assert lines[6].split() == ["#", "token", "logprob", "rank", "top"]
    assert lines[7].split() == ["0", "'<|im_start|>'", "-", "-"]
    assert lines[8].split() == ["1", "'hi'", "-3.5000", "4", "'ho'", "-0.5000"]
    assert len(lines) == 9

    out = json.loads(printed(True))
    assert [lp["top"][0]["token"] for lp in out["logprobs"]] == ["blu", "ish"]
    assert out["logprobs"][1]["logprob"] == -9999.0  # JSON has no -inf: vLLM's floor
    assert out["prompt_logprobs"][0] is None and out["prompt_logprobs"][1]["rank"] == 4
