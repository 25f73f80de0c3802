"""Embedded `epd ask` shows one progress display on stderr, its own: the "epd: loading" line, then
each stage's lines. It loads the whole model through transformers' `from_pretrained`, which drew
its "Loading weights" bar beside them (`hf_loading.hide_transformers_bars` hides it, as for
`epd serve --colocate`); an error while loading still says what went wrong there."""

from __future__ import annotations

import json
import re
import shutil

from tests.stack import run_epd_forked

QUESTION = "what colour is the square?"


def test_embedded_ask_shows_its_own_progress_and_no_loading_bar(tiny_models, media_files):
    done = run_epd_forked("ask", str(media_files["mp4"]), QUESTION, "--model", str(tiny_models["qwen2_vl"]),
                          "--num-frames", "2", "--max-new-tokens", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Loading weights" not in done.stderr and "it/s]" not in done.stderr, done.stderr
    assert f"\nepd: loading {tiny_models['qwen2_vl']} (embedded mode)\n" in f"\n{done.stderr}", done.stderr
    assert re.search(r"^  \[encode\] done in \d+ ms$", done.stderr, re.MULTILINE), done.stderr


def test_an_error_while_the_model_loads_is_still_shown(tiny_models, media_files, tmp_path):
    """The bar is hidden, not stderr: a checkpoint transformers refuses (a vocabulary the weights
    do not have) still ends `epd ask` with a message on stderr."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["qwen2_vl"], broken)
    config = json.loads((broken / "config.json").read_text())
    text = config.get("text_config", config)
    text["vocab_size"] = text["vocab_size"] * 2
    (broken / "config.json").write_text(json.dumps(config))
    done = run_epd_forked("ask", str(media_files["mp4"]), QUESTION, "--model", str(broken), "--num-frames", "2",
                          "--max-new-tokens", "3")  # fmt: skip
    assert done.returncode != 0, done.stderr[-2000:]
    assert "Loading weights" not in done.stderr, done.stderr
    # epd's one line, and transformers' own report of what did not fit (a log record, not a bar).
    assert f"epd: cannot load {broken}: " in done.stderr, done.stderr[-2000:]
    assert "Reinit due to size mismatch" in done.stderr, done.stderr[-2000:]
