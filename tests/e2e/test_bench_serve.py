"""`epd bench serve` end to end on a tiny setting: well-formed, consistent numbers."""

from __future__ import annotations

import json
import subprocess

from tests.stack import ROOT, child_env, epd_command


def test_bench_serve_against_a_stack(shared_stack, tiny_models, media_files, tmp_path):
    out = tmp_path / "serve.json"
    # the session's plain stack (tests/conftest.py)
    proc = subprocess.run(
        epd_command("bench", "serve", "--endpoint", shared_stack.gateway, "--model", str(tiny_models["qwen2_vl"]),
                    "--videos", str(media_files["mp4"]), str(media_files["mp4_b"]), "--num-requests", "4",
                    "--concurrency", "2", "--num-frames", "4", "--max-new-tokens", "6", "--ignore-eos",
                    "--output-json", str(out)),
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for name in ("stack", "hf", "embedded"):
        s = report[name]
        assert s["num_requests"] == 4 and s["num_completed"] + s["num_failed"] == 4 and s["num_failed"] == 0
        assert s["num_output_tokens"] == 4 * 6, name  # --ignore-eos: every request makes 6 tokens
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            v = s[key]
            assert 0 < v["p50"] <= v["p90"] <= v["p99"], (name, key, v)
        assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
        assert s["num_good"] <= s["num_completed"]
    assert all(r["num_output_tokens"] == 6 and len(r["itl_ms"]) == 5 for r in report["stack_requests"])
    assert "| ttft_ms |" in proc.stdout and "ratio (stack vs baseline)" in proc.stdout
