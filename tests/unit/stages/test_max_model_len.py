"""--max-model-len (vLLM's) on prefill's settings and engine, without a model: it may only lower
the model's context, and the context it leaves is the one the engine checks and reports."""

from __future__ import annotations

import logging

import pytest

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import ModelLoadError
from epd.model_runtime.sampling import MAX_NEW_TOKENS
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine


class _Adapter:
    """What the engine reads of a model at construction and in `model_info`."""

    vocab_size = 512
    family = "qwen2_vl"
    supports_chunked_prefill = True

    def __init__(self, context_tokens: int | None) -> None:
        self.context_tokens = context_tokens

    def settle_tokenizer(self) -> None:
        pass

    def single_tokens(self, texts) -> dict[str, int]:
        return {}


@pytest.mark.parametrize("value", [0, -1])
def test_a_max_model_len_below_one_token_is_refused_naming_the_flag(value):
    with pytest.raises(
        ValueError, match=rf"max_model_len \(--max-model-len\) must be >= 1 token, got {value}"
    ):
        PrefillConfig(max_model_len=value)


def test_max_model_len_may_only_lower_the_models_context():
    assert PrefillConfig().served_context(32768) == 32768  # unset: the model's own
    assert PrefillConfig().served_context(None) is None
    assert PrefillConfig(max_model_len=1000).served_context(32768) == 1000
    assert PrefillConfig(max_model_len=32768).served_context(32768) == 32768
    assert PrefillConfig(max_model_len=1000).served_context(None) == 1000  # a model that says none
    with pytest.raises(
        ValueError, match=r"--max-model-len 32769 is more than this model's context of 32768 tokens"
    ):
        PrefillConfig(max_model_len=32769).served_context(32768)


def test_the_prompt_limit_is_the_served_context_when_that_is_shorter():
    config = PrefillConfig(max_prompt_tokens=4000)
    assert config.served_prompt_tokens(None) == 4000
    assert config.served_prompt_tokens(32768) == 4000
    assert config.served_prompt_tokens(100) == 100


def test_the_engine_reports_the_context_max_model_len_leaves_and_refuses_a_larger_one(tmp_path):
    """`/v1/models`' max_model_len (`ModelInfo.max_model_len`) was the model's context whatever
    the operator wanted; and a value above the model's is refused when the model is known, as a
    model that cannot be served (`epd serve`'s exit 3 and one line)."""
    engine = PrefillEngine(PrefillConfig(max_model_len=60), _Adapter(100))  # type: ignore[arg-type]
    assert (engine.context_tokens, engine.max_prompt_tokens) == (60, 60)
    info = engine.model_info()
    assert (info.context_tokens, info.max_prompt_tokens, info.max_new_tokens) == (60, 60, MAX_NEW_TOKENS)
    assert info.max_model_len == 60
    assert PrefillEngine(PrefillConfig(), _Adapter(100)).model_info().max_model_len == 100  # type: ignore[arg-type]
    model_dir = str(tmp_path / "model")
    with pytest.raises(ModelLoadError) as refused:
        PrefillEngine(PrefillConfig(ModelConfig(model=model_dir), max_model_len=101), _Adapter(100))  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"cannot load {model_dir}: --max-model-len 101 is more than this model's context of 100 tokens "
        "(config.json's max_position_embeddings); it may only lower it: pass at most 100, or leave it out"
    )


def test_a_max_model_len_past_the_prompt_and_answer_limits_is_served_as_those_with_a_warning(caplog):
    """epd bounds the prompt (--max-prompt-tokens, 32,768) and the answer (--max-new-tokens-limit)
    on their own: a --max-model-len above their sum cannot be reached, and the operator is told
    what /v1/models will say instead, and which flag reaches it."""
    config = PrefillConfig(max_model_len=200_000, max_new_tokens_limit=1000)
    with caplog.at_level(logging.WARNING, logger="epd.prefill_svc.engine"):
        engine = PrefillEngine(config, _Adapter(262_144))  # type: ignore[arg-type]
    assert engine.model_info().max_model_len == 32768 + 1000
    assert caplog.messages == [
        "--max-model-len 200000: prompts are bounded by 32768 tokens (--max-prompt-tokens) "
        "and answers by 1000 (--max-new-tokens-limit), so a request has 33768 at most "
        "(/v1/models' max_model_len); raise --max-prompt-tokens to reach 200000"
    ]
