"""`epd bench serve` end to end on a tiny setting: well-formed, consistent numbers."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.stack import ROOT, child_env, epd_command, run_epd_forked


def test_bench_serve_against_a_stack(shared_stack, tiny_models, media_files, tmp_path):
    out = tmp_path / "serve.json"
    # the session's plain stack (tests/conftest.py); the bench forked from the session's zygote, as
    # its baselines import torch (its start-up is not what this tests)
    proc = run_epd_forked(
        "bench", "serve", "--endpoint", shared_stack.gateway, "--model", str(tiny_models["qwen2_vl"]),
        "--videos", str(media_files["mp4"]), str(media_files["mp4_b"]), "--num-requests", "4", "--concurrency", "2",
        "--num-frames", "4", "--max-new-tokens", "6", "--ignore-eos", "--output-json", str(out), timeout_s=600,
    )  # fmt: skip
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


def _sweep(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        epd_command("bench", "serve", *args),
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=600,
    )


def test_bench_serve_concurrency_sweep_and_plot(shared_stack, media_files, tmp_path):
    """`--concurrency 1,2`: both levels run, one table row each, in the JSON; `--plot` writes a PNG
    (when matplotlib, the `bench` extra, is installed). No timing assertions."""
    import importlib.util

    have_matplotlib = importlib.util.find_spec("matplotlib") is not None
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    proc = _sweep(
        [
            "--endpoint",
            shared_stack.gateway,
            "--videos",
            str(media_files["mp4"]),
            str(media_files["mp4_b"]),
            "--num-requests",
            "2",
            "--concurrency",
            "1,2",
            "--num-frames",
            "4",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--no-baselines",
            "--output-json",
            str(out),
            *(["--plot", str(png)] if have_matplotlib else []),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["sweep"]] == [1, 2]
    for level in report["sweep"]:
        s = level["summary"]
        assert s["num_completed"] == 2 and s["num_failed"] == 0 and s["num_output_tokens"] == 2 * 4
    assert report["stack"] == report["sweep"][0]["summary"]  # the single-level names still hold
    table = proc.stdout[proc.stdout.index("== concurrency sweep") :]
    assert "| in flight | ok | req/s | output tok/s | TTFT p50 ms |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2"] and all("| 2/2 |" in r for r in rows), table
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_bench_serve_openai_sweep(shared_stack, media_files, tmp_path):
    """The same load over the OpenAI-compatible HTTP API (streaming SSE), 2 levels."""
    out = tmp_path / "openai.json"
    proc = _sweep(
        [
            "--openai",
            f"http://127.0.0.1:{shared_stack.http_port}",
            "--videos",
            str(media_files["mp4"]),
            "--num-requests",
            "2",
            "--concurrency",
            "1,2",
            "--num-frames",
            "4",
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--no-baselines",
            "--output-json",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["sweep"]] == [1, 2]
    for level in report["sweep"]:
        assert level["summary"]["num_failed"] == 0 and level["summary"]["num_output_tokens"] == 2 * 4
        for r in level["requests"]:  # usage and epd's per-chunk token_ids agree; every gap is measured
            assert r["num_output_tokens"] == 4 and len(r["itl_ms"]) == 3 and r["num_prompt_tokens"] > 0
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
    assert "OpenAI API" in proc.stdout


@pytest.mark.parametrize("door", ["grpc", "openai"])
def test_bench_serve_with_text_only_runs_the_questions_alone_too(shared_stack, tmp_path, door):
    """`--with-text-only`: each level again without the media (no encoder call: no video_decode
    time on the gRPC door, fewer prompt tokens on the OpenAI one), and the ratio table."""
    import numpy as np
    from PIL import Image

    # Bytes no other test sends, so the encoder's token cache does not serve the first request.
    image = tmp_path / "unseen.png"
    Image.fromarray(np.random.default_rng(8).integers(0, 256, (64, 80, 3), dtype=np.uint8)).save(image)
    out = tmp_path / "text_only.json"
    front = ["--endpoint", shared_stack.gateway] if door == "grpc" else [
        "--openai", f"http://127.0.0.1:{shared_stack.http_port}"]  # fmt: skip
    proc = _sweep([*front, "--videos", str(image), "--num-requests", "2", "--concurrency", "1",
                   "--num-frames", "4", "--max-new-tokens", "4", "--ignore-eos", "--no-baselines",
                   "--with-text-only", "--output-json", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (with_media,), (alone,) = report["sweep"], report["text_only_sweep"]
    assert alone["summary"]["num_failed"] == 0 and alone["summary"]["num_output_tokens"] == 2 * 4
    if door == "grpc":
        assert any(r["server_timings"]["video_decode_ms"] > 0 for r in with_media["requests"])
        assert all(r["server_timings"]["video_decode_ms"] == 0 == r["server_timings"]["encode_ms"]
                   for r in alone["requests"])  # fmt: skip
    else:
        assert max(r["num_prompt_tokens"] for r in alone["requests"]) < min(
            r["num_prompt_tokens"] for r in with_media["requests"])  # fmt: skip
    assert "| ratio (text only / with media) | TTFT p50 |" in proc.stdout


def test_bench_serve_with_completions_runs_the_rendered_prompts_raw(shared_stack, tmp_path):
    """`--with-completions`: each level's questions as text-only chat requests and as POST
    /v1/completions of the prompt the server renders for them (/tokenize, /detokenize): the two
    series have the same prompt tokens, every completion streams its tokens, and the ratio table
    with both prompt lengths is printed. No timing assertions."""
    out = tmp_path / "completions.json"
    proc = _sweep(["--openai", f"http://127.0.0.1:{shared_stack.http_port}", "--num-requests", "2",
                   "--questions", "what colour is the circle?", "--concurrency", "1", "--max-new-tokens", "4",
                   "--ignore-eos", "--no-baselines", "--with-completions", "--output-json", str(out)])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    (chat,), (raw,) = report["text_only_sweep"], report["completions_sweep"]
    for level in (chat, raw):
        assert level["summary"]["num_failed"] == 0 and level["summary"]["num_output_tokens"] == 2 * 4
        assert all(r["num_output_tokens"] == 4 and 0 < r["ttft_ms"] <= r["e2e_ms"] for r in level["requests"])
    chat_tokens = [r["num_prompt_tokens"] for r in chat["requests"]]
    assert chat_tokens == [r["num_prompt_tokens"] for r in raw["requests"]] and min(chat_tokens) > 0
    assert len(set(chat_tokens)) == 1  # one question: one prompt length
    table = proc.stdout[proc.stdout.index("| ratio (completions / text-only chat) |") :]
    assert f"| {chat_tokens[0]} / {chat_tokens[0]} |" in table.splitlines()[2], table


def test_bench_serve_with_completions_needs_the_openai_door(shared_stack):
    proc = _sweep(["--endpoint", shared_stack.gateway, "--num-requests", "1", "--no-baselines",
                   "--with-completions"])  # fmt: skip
    assert proc.returncode == 2 and "--with-completions needs --openai" in proc.stderr
