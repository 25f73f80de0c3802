"""vLLM's `--generation-config` / `--override-generation-config` (`ModelConfig.get_diff_sampling_param`):
the model's generation_config.json sampling fields (read by prefill, `model_defaults`) become the
defaults of the fields a request leaves unset, on every door (resolved in one place: `parse_generation`
for the HTTP API, `generation_from_proto` for gRPC), and a field the request sets wins."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from epd.cli import configs, stack_commands
from epd.cli.main import build_parser
from epd.client.request import build_header
from epd.gateway.generation_options import parse_generation
from epd.model_runtime.generation_defaults import (
    GenerationDefaults,
    announce,
    generation_defaults,
    model_defaults,
    with_sampling_defaults,
)
from epd.model_runtime.sampling import GenerationConfig
from epd.transport import convert
from epd.v1 import common_pb2

QWEN3_VL = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 128}


def model_dir(tmp_path: Path, **config) -> Path:
    """A model folder whose generation_config.json holds `config` beside what every one holds."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "do_sample": True, **config})
    )
    return tmp_path


def resolved(source: str, model: str, override: str = "") -> GenerationConfig:
    """What the front door's flags take with `model`'s file as its prefill reports it."""
    return generation_defaults(source, override).resolve(model_defaults(model))


def test_auto_takes_the_models_sampling_fields_and_nothing_else(tmp_path, caplog):
    got = model_defaults(str(model_dir(tmp_path, min_p=0.05, **QWEN3_VL)))
    # not eos_token_id, not do_sample; in SAMPLING_KEYS' order
    assert got == (
        ("repetition_penalty", 1.05), ("temperature", 0.7), ("top_k", 20), ("top_p", 0.8), ("min_p", 0.05),
        ("max_new_tokens", 128),
    )  # fmt: skip
    generation = resolved("auto", str(tmp_path))
    assert (generation.temperature, generation.top_p, generation.top_k) == (0.7, 0.8, 20)
    assert (generation.repetition_penalty, generation.min_p, generation.max_new_tokens) == (1.05, 0.05, 128)
    with caplog.at_level(logging.INFO, "epd.model_runtime.generation_defaults"):
        announce(generation, "auto")
    [record] = caplog.records
    line = record.getMessage()
    assert record.levelno == logging.WARNING, "answers change: said as vLLM says it"
    assert "temperature=0.7" in line and "max_tokens=128" in line and "--generation-config vllm" in line


def test_a_config_without_sampling_fields_changes_nothing(tmp_path, caplog):
    """The tests' tiny models: their answers stay `generate()`'s greedy ones."""
    assert model_defaults(str(model_dir(tmp_path))) == ()
    assert resolved("auto", str(tmp_path)) == GenerationConfig()
    assert model_defaults(str(tmp_path / "absent")) == ()
    assert GenerationDefaults("auto").resolve(None) == GenerationConfig()  # prefill does not say
    with caplog.at_level(logging.INFO, "epd.model_runtime.generation_defaults"):
        announce(GenerationConfig(), "auto")
    assert "none from --generation-config auto" in caplog.records[0].getMessage()


def test_vllm_ignores_the_model_and_dir_reads_another_folder(tmp_path):
    model = model_dir(tmp_path / "model", **QWEN3_VL)
    assert resolved("vllm", str(model)) == GenerationConfig()
    other = model_dir(tmp_path / "other", top_k=1)
    assert generation_defaults(str(other)).given == {"top_k": 1}
    assert resolved(str(other), str(model)) == GenerationConfig(top_k=1)  # not the model's


def test_the_override_merges_over_the_file_and_alone_under_vllm(tmp_path):
    model = str(model_dir(tmp_path, **QWEN3_VL))
    got = resolved("auto", model, '{"temperature": 0.2, "max_new_tokens": 64}')
    assert got == with_sampling_defaults(
        GenerationConfig(), {**QWEN3_VL, "temperature": 0.2, "max_new_tokens": 64}
    )
    assert resolved("vllm", model, '{"repetition_penalty": 1.3}') == GenerationConfig(repetition_penalty=1.3)
    other = model_dir(tmp_path / "other", top_k=1, top_p=0.5)
    assert resolved(str(other), model, '{"top_k": 2}') == GenerationConfig(top_k=2, top_p=0.5)
    assert resolved("vllm", model, '{"top_k": -1}').top_k == 0  # vLLM's off is 0, as on every door


@pytest.mark.parametrize(
    "source,override,message",
    [
        ("vllm", "{temperature: 1}", "--override-generation-config is not JSON"),
        ("vllm", "[1]", "--override-generation-config must be a JSON object"),
        ("vllm", '{"temprature": 0.5}', "temprature is not a sampling default; the keys taken are"),
        ("vllm", '{"top_p": 0}', r"--override-generation-config: top_p must be in \(0, 1\], got 0"),
        ("vllm", '{"top_k": 2.5}', "top_k must be an integer, got 2.5"),
        ("vllm", '{"temperature": "hot"}', 'temperature must be a number, got "hot"'),
        ("vllm", '{"max_new_tokens": 0}', "max_new_tokens must be between 1 and"),
        ("FOLDER", "", "no generation_config.json in that folder"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(tmp_path, source, override, message):
    with pytest.raises(ValueError, match=message):
        generation_defaults(str(tmp_path) if source == "FOLDER" else source, override)


def test_a_bad_value_in_the_models_file_is_logged_and_not_reported(tmp_path, caplog):
    """Prefill reads it, not knowing the front door's flags (under vllm it serves on): it says
    so in its log and reports the defaults not known (the front door says so too)."""
    with caplog.at_level(logging.ERROR, "epd.model_runtime.generation_defaults"):
        assert model_defaults(str(model_dir(tmp_path, repetition_penalty=0))) is None
        (tmp_path / "generation_config.json").write_text("{")
        assert model_defaults(str(tmp_path)) is None
    first, second = (r.getMessage() for r in caplog.records)
    assert "the model's" in first and "repetition_penalty must be > 0" in first
    assert "cannot read it as JSON" in second


def test_the_http_doors_take_the_defaults_and_a_field_the_request_sets_wins():
    defaults = with_sampling_defaults(GenerationConfig(), QWEN3_VL)
    unset = parse_generation({}, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert unset.max_new_tokens == 128 and unset.fit_max_new_tokens  # the default, fitted to the context
    given = parse_generation(
        {"temperature": 0, "top_p": 1, "top_k": -1, "repetition_penalty": 1, "max_tokens": 5}, defaults
    )
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0, 1, 0, 1)
    assert given.max_new_tokens == 5 and not given.fit_max_new_tokens


def test_grpc_takes_the_defaults_of_the_fields_left_unset():
    """temperature, top_k and min_p by their presence (0 is greedy / off: the SDK sends a given 0),
    top_p, repetition_penalty and max_new_tokens by 0, which no request may send."""
    defaults = with_sampling_defaults(GenerationConfig(), {**QWEN3_VL, "min_p": 0.05})
    unset = convert.generation_from_proto(common_pb2.GenerationParams(), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p) == (0.7, 0.8, 20, 0.05)
    assert (unset.repetition_penalty, unset.max_new_tokens) == (1.05, 128)
    header = build_header("q?", 0, "", {"temperature": 0.0, "top_k": 0, "min_p": 0.0, "top_p": 0.5})
    given = convert.generation_from_proto(header.generation, defaults)
    assert (given.temperature, given.top_p, given.top_k, given.min_p) == (0.0, 0.5, 0, 0.0)
    assert given.repetition_penalty == 1.05  # still unset


def test_every_serve_form_takes_the_flags_as_given(tmp_path):
    """No form reads the model's file at the front door: auto is the model's as prefill reports it
    (`Pipeline.request_defaults`), so the stack's gateway gets the flag as given, as one alone."""
    model = str(model_dir(tmp_path, repetition_penalty=1.3))
    serve = build_parser().parse_args(["serve", "--model", model])
    assert configs.colocated_gateway_config(serve).generation == GenerationDefaults("auto")
    words = stack_commands.gateway_flags(serve)
    assert words[words.index("--generation-config") + 1] == "auto"
    gateway = build_parser().parse_args(["serve", "gateway", "--generation-config", model])
    assert configs.gateway_config(gateway).generation == GenerationDefaults(
        model, {"repetition_penalty": 1.3}
    )
    alone = build_parser().parse_args(["serve", "gateway"])
    assert configs.gateway_config(alone).generation == GenerationDefaults("auto")
    off = build_parser().parse_args(["serve", "--model", model, "--generation-config", "vllm"])
    assert configs.colocated_gateway_config(off).generation == GenerationDefaults("vllm")


def test_epd_asks_unset_flags_take_the_defaults_and_a_flag_it_sets_wins():
    """Embedded: the model's defaults fill the flags left unset; with --endpoint they stay unset on
    the wire (None: the SDK leaves them out), for the gateway's own defaults."""
    defaults = with_sampling_defaults(GenerationConfig(), QWEN3_VL)
    args = build_parser().parse_args(["ask", "v.mp4", "q?", "--top-k", "3"])
    generation = configs.generation_config(args, defaults)
    assert (generation.temperature, generation.top_p, generation.top_k, generation.max_new_tokens) == (
        0.7,
        0.8,
        3,
        128,
    )
    assert generation.fit_max_new_tokens  # as a request without max_tokens
    assert configs.generation_config(args) == replace(GenerationConfig(top_k=3), fit_max_new_tokens=True)
    options = configs.generation_options(args)
    assert (
        options["top_k"] == 3
        and options["temperature"] is options["top_p"] is options["max_new_tokens"] is None
    )


def test_epd_ask_refuses_a_bad_override_before_the_model_loads(capsys, tmp_path):
    from epd.cli.main import main

    assert (
        main(["ask", "--no-video", "q?", "--model", str(tmp_path), "--override-generation-config", "{"]) == 2
    )
    assert "--override-generation-config is not JSON" in capsys.readouterr().err
