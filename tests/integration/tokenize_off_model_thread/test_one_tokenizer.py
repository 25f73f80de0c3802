"""Prefill's tokenizer threads (prompts' renders, /tokenize, /detokenize) and its model thread share
the model's one tokenizer: no call of ours changes the tokenizer's truncation/padding settings once
the engine settled them (`VLMAdapter.settle_tokenizer`), so the threads only read it, and prefill
keeps no second copy (46-141 MiB with a Qwen2-sized vocabulary). A change while another thread
encodes would alter that call's ids (or, before tokenizers 0.23.1, fail itself: "Already
borrowed"). Every family's continued final message is tokenised as its processor's. Real tiny
models of every family, real processors and fast tokenizers."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from epd.model_runtime.adapter import RenderOptions
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.tokenize import TokenizeInput
from tests.families import FAMILIES
from tests.integration.tokenize_off_model_thread.held_renders import (
    _conversation,
)


def _live_tokenizers() -> int:
    """Rust tokenizers alive in this process (`tokenizers.Tokenizer`: what a copy of a fast
    tokenizer adds, its vocabulary and merges with it)."""
    from tokenizers import Tokenizer

    gc.collect()
    return sum(isinstance(o, Tokenizer) for o in gc.get_objects())


def _backend_settings(adapter) -> tuple:
    """What transformers changes on the Rust tokenizer when a call asks for other settings."""
    backend = adapter.tokenizer.backend_tokenizer
    return backend.truncation, backend.padding, backend.encode_special_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_keeps_one_tokenizer_that_no_call_changes(checkpoints, family):
    """The engine adds no tokenizer to the process (it kept a deep copy for /tokenize), and no
    call that prefill's two threads make (the model thread's prompts, /tokenize's and
    /detokenize's) changes the tokenizer's settings, so that they may run at once: every family's
    tokenizer is left as the engine settled it, and the ids are the adapter's."""
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    before = _live_tokenizers()
    engine = PrefillEngine(PrefillConfig(), adapter)
    assert _live_tokenizers() == before
    settled = _backend_settings(adapter)
    conversation = _conversation("what colour is the sky?")
    prompt_ids = adapter.build_prompt(conversation, None).input_ids[0].tolist()
    open_turn = [*conversation, {"role": "assistant", "content": [{"type": "text", "text": "The sky"}]}]
    calls = {
        "build_prompt": lambda: adapter.build_prompt(conversation, None),
        "build_raw_prompt": lambda: adapter.build_raw_prompt("a red circle"),
        "detokenize": lambda: adapter.detokenize(prompt_ids),
        "tokenize": lambda: engine.tokenize(TokenizeInput(prompt="a red circle", return_token_strs=True)),
        "tokenize messages": lambda: engine.tokenize(
            TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False)
        ),
        "tokenize continued": lambda: engine.tokenize(
            TokenizeInput(
                messages=from_chat_template(open_turn),
                add_special_tokens=False,
                template=ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True),
            )
        ),
        "detokenize route": lambda: engine.detokenize(prompt_ids),
    }
    for name, call in calls.items():
        call()
        assert _backend_settings(adapter) == settled, f"{name} changed the tokenizer's settings"
    request = TokenizeInput(messages=from_chat_template(conversation), add_special_tokens=False)
    assert engine.tokenize(request).token_ids == prompt_ids


def test_a_tokenizer_json_with_truncation_and_padding_is_settled_before_a_second_thread(
    tiny_models, tmp_path
):
    """A checkpoint whose tokenizer.json sets truncation and padding (transformers' load turns
    them on): the first call of ours turns them off again, a change that must not happen while
    another thread encodes. The engine makes it at construction, so the settings it leaves are
    those every later call asks for, and the ids are transformers' (neither truncated nor padded)."""
    model = shutil.copytree(tiny_models["qwen2_vl"], tmp_path / "model")
    tokenizer_json = json.loads((model / "tokenizer.json").read_text())
    tokenizer_json["truncation"] = {
        "direction": "Right",
        "max_length": 4,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    tokenizer_json["padding"] = {
        "strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>",
    }  # fmt: skip
    (model / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    adapter = load_adapter(ModelConfig(model=str(model)), "prefill")
    backend = adapter.tokenizer.backend_tokenizer
    assert backend.truncation is not None and backend.padding is not None  # as loaded
    engine = PrefillEngine(PrefillConfig(), adapter)
    assert backend.truncation is None and backend.padding is None
    text = "a red circle moves left and a blue square moves right"
    ids = engine.tokenize(TokenizeInput(prompt=text, add_special_tokens=False)).token_ids
    assert backend.truncation is None and backend.padding is None
    assert ids == adapter.tokenizer(text, add_special_tokens=False)["input_ids"] and len(ids) > 4


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_continues_a_final_message_and_names_its_tokens_as_its_processor(checkpoints, family):
    """/tokenize's continue_final_message and return_token_strs in every family: the ids of the
    family's own processor's rendering with the last message left open, and its tokenizer's
    tokens of them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(checkpoints[family]))
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "prefill")
    conversation = [
        *_conversation("what colour is the sky?"),
        {"role": "assistant", "content": [{"type": "text", "text": "The sky is"}]},
    ]
    rendered = processor.apply_chat_template(
        conversation, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert rendered.endswith("The sky is")
    ids = adapter.tokenize_conversation(
        conversation, False, RenderOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert ids == processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert adapter.token_strings(ids) == processor.tokenizer.convert_ids_to_tokens(ids)
