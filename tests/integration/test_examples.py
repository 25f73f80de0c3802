"""examples/*.py, which README.md points SDK and OpenAI-client users to, run against a real stack
as a user runs them (`python examples/X.py`, with the flags that point them at it): each answers,
and says what it says it shows. An example that stops matching the SDK or the HTTP API fails here,
not in a user's hands. Run in this process (runpy), against the shared stack's separate servers."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "sample.mp4"


def run_example(name: str, *args: str, monkeypatch, capsys) -> tuple[str, str]:
    """Its stdout and stderr; any exit other than a normal return fails the test."""
    monkeypatch.delenv("EPD_API_KEY", raising=False)  # the shared stack has no key
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *args])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_every_example_is_run_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "ask_async_stream.py",
        "ask_sync.py",
        "openai_http.py",
    ], "a new example: run it in this module too"


def test_ask_sync_asks_then_reuses_the_uploaded_video(shared_stack, monkeypatch, capsys):
    out, _ = run_example(
        "ask_sync.py",
        str(SAMPLE),
        "what colour is the circle?",
        "--endpoint",
        shared_stack.gateway,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    lines = out.splitlines()
    assert any(" frames, " in line and "TTFT" in line for line in lines), out
    assert lines[-1] == "uploaded 0 bytes, encoder cache hit: True", out  # the follow-up sent only the hash


def test_ask_async_stream_streams_events_then_answers_concurrently(shared_stack, monkeypatch, capsys):
    out, err = run_example(
        "ask_async_stream.py",
        str(SAMPLE),
        "--endpoint",
        shared_stack.gateway,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    for stage in ("upload", "encode", "prefill", "generate"):
        assert f"] {stage} finished" in err, err  # the stage events, as they happen
    assert "-> " in out and "TTFT" in out and "attempt(s)" in out, out  # the stream's AskResult
    assert out.count("| cache hit: True") == 2, out  # the two concurrent questions reuse the encode


def test_openai_http_streams_the_answer_and_the_epd_summary(shared_stack, monkeypatch, capsys):
    pytest.importorskip("openai")
    out, _ = run_example(
        "openai_http.py",
        str(SAMPLE),
        "what colour is the circle?",
        "--base-url",
        f"http://127.0.0.1:{shared_stack.http_port}/v1",
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert "8 frames, TTFT " in out and "encoder cache hit: " in out, out  # the last chunk's `epd` object
