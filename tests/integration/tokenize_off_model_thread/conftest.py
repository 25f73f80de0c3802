"""Fixtures of the tests of prefill's tokenizer threads (prompts' renders, /tokenize and /detokenize
off the model thread): the tiny Qwen2-VL's prefill adapter and processor, a checkpoint of every
family."""

from __future__ import annotations

import pytest

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from tests.families import family_checkpoints


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "prefill")


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_models["qwen2_vl"]))


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("tokenize_family_models"))
