"""bench/bench_conversation.py end to end at a tiny size: it starts its own server (colocated, the
fastest start), runs a 3-turn conversation about one clip with each later turn also asked cold,
and prints every row of its table and zero answer mismatches."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.stack import ROOT, child_env


def test_the_conversation_benchmark_runs_at_a_tiny_size(tiny_models, tmp_path):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_conversation.py"), "--model", str(tiny_models["qwen2_vl"]),
           "--work-dir", str(tmp_path), "--num-clips", "1", "--num-frames", "4", "--clip-size", "112",
           "--clip-seconds", "4", "--max-tokens", "3", "--colocate", "--threads", "1", "--timeout-s", "120"]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=170)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    for row in ("turn 1: first question (cold)", "turn 2: follow-up", "turn 2: same, asked cold",
                "turn 3: follow-up", "turn 3: same, asked cold"):  # fmt: skip
        assert re.search(rf"^{re.escape(row)}\s+1\s+\d", out, re.M), out
    assert "ratio cold / follow-up, turn 2: TTFT" in out and "ratio cold / follow-up, turn 3: TTFT" in out
    assert "answer mismatches (follow-up vs asked cold): 0 of 2" in out, out
    assert "clip 1/1: TTFT turn 1" in out  # progress lines


def test_the_conversation_benchmark_puts_the_video_after_a_text_turn(tiny_models, tmp_path):
    """--video-after-text: "hello" -> answer -> [video, question]; the video turn reuses the text
    turn's cached prefix (cached tokens > 0), the same turn under a new cache_salt reuses none, and
    both give the same answer."""
    import json

    out_json = tmp_path / "after_text.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_conversation.py"), "--model", str(tiny_models["qwen2_vl"]),
           "--work-dir", str(tmp_path), "--num-clips", "1", "--num-frames", "4", "--clip-size", "112",
           "--clip-seconds", "4", "--max-tokens", "3", "--colocate", "--threads", "1", "--timeout-s", "120",
           "--video-after-text", "--output-json", str(out_json)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=170)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    for row in ("turn 1: hello (text only)", "turn 2: video after text", "turn 2: same, new cache_salt"):
        assert re.search(rf"^{re.escape(row)}\s+1\s+\d", out, re.M), out
    assert "ratio new cache_salt / prefix reused, turn 2: TTFT" in out
    assert "answer mismatches (prefix reused vs new cache_salt): 0 of 1" in out, out
    (turns,) = json.loads(out_json.read_text())["results"]
    assert 0 < turns["turn2"]["cached_tokens"] < turns["turn2"]["prompt_tokens"], turns
    assert turns["turn2_cold"]["cached_tokens"] == 0 and turns["turn1"]["prompt_tokens"] > 0, turns
