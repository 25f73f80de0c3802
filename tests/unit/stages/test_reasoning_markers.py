"""`ModelInfo.reasoning_markers`: which of vLLM's think markers are single tokens of the served
model's tokenizer, and their ids (`reasoning_marker_ids`), read by prefill from the real tiny
checkpoints (Qwen3.5's tokenizer has `<think>` and `</think>` as added tokens, Qwen2-VL's has
neither), carried over the wire and merged over replicas; `parser_misfit` turns a missing one into the message a chat request is refused with."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from epd.gateway.reasoning import MarkerIds, marker_ids, parser_misfit
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.stages.model_info import ModelInfo, common_model_info
from epd.transport.model_info import model_info_from_proto, model_info_to_proto


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("markers") / "qwen3_5", TinyVLMSpec(family="qwen3_5"))


def _info(model_dir) -> ModelInfo:
    adapter = load_adapter(ModelConfig(model=str(model_dir)), "all")
    return PrefillEngine(PrefillConfig(), adapter).model_info()


def test_prefill_reports_the_think_markers_a_thinking_models_tokenizer_has(qwen3_5, tiny_models):
    thinking = _info(qwen3_5)
    assert thinking.reasoning_markers == ("<think>", "</think>")
    # with their ids, by which the front door counts the reasoning tokens (it has no tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_5))
    ids = tuple(tokenizer.convert_tokens_to_ids(["<think>", "</think>"]))
    assert thinking.reasoning_marker_ids == ids and marker_ids(thinking, "qwen3") == MarkerIds(*ids)
    assert model_info_from_proto(model_info_to_proto(thinking)) == thinking
    assert parser_misfit("qwen3", thinking) is None

    plain = _info(tiny_models["qwen2_vl"])
    assert (plain.reasoning_markers, plain.reasoning_marker_ids) == ((), ())
    assert model_info_from_proto(model_info_to_proto(plain)) == plain
    for parser in ("qwen3", "deepseek_r1"):
        message = parser_misfit(parser, plain)
        assert message is not None
        assert f"--reasoning-parser {parser}" in message
        assert "(qwen2_vl) lacks <think> and </think>" in message
    assert parser_misfit("", plain) is None  # no parser: nothing to check
    assert parser_misfit("qwen3", None) is None  # not known yet: prefill has not answered


def test_replicas_have_a_marker_only_when_every_tokenizer_has_it():
    both = ModelInfo(1024, 4096, 4096, 512, "qwen3_5", reasoning_markers=("<think>", "</think>"))
    end_only = ModelInfo(1024, 4096, 4096, 512, "other", reasoning_markers=("</think>",))
    merged = common_model_info([both, end_only])
    assert merged is not None and merged.reasoning_markers == ("</think>",)
    message = parser_misfit("deepseek_r1", merged)
    assert message is not None and "lacks <think>:" in message
