"""A prompt whose expanded visual placeholders the tokenizer does not keep whole is the server's
error, not the client's (`hf_text.checked_visual_mask`): the text parts' and the template's own
placeholders are refused before the expansion, so only the checkpoint (its tokenizer without the
placeholder as one added token) can make the count differ. Prefill answers INTERNAL, the message
(what the operator should check) for the server log; before, it was INVALID_ARGUMENT, telling the
client to change a request that nothing in it could fix.

The checkpoint is the tiny Qwen2-VL's tokenizer, processor and config as saved, its tokenizer
files edited as a broken conversion would leave them: `<|video_pad|>` still in the vocabulary but
no added token, so the real tokenizer splits it into byte pieces."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
import torch

from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.stages.contracts import EncodedMedia
from epd.stages.messages import question_messages
from epd.transport.errors import status_of

PAD = "<|video_pad|>"


@pytest.fixture(scope="module")
def split_placeholder_checkpoint(tiny_models, tmp_path_factory):
    """The tiny Qwen2-VL's files but its weights (a prompt needs none), `PAD` no added token."""
    source = tiny_models["qwen2_vl"]
    target = tmp_path_factory.mktemp("split_placeholder")
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, target / path.name)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != PAD]
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["extra_special_tokens"].remove(PAD)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def _render(checkpoint):
    """The prefill engine's render of a question about a 2 x 4 x 4 video grid (8 visual tokens)."""
    adapter = Qwen2VLAdapter(str(checkpoint), ModelConfig(), set())  # prompts only, no weights
    meta = VisualMeta("video", (2, 4, 4), 1.0, 8)
    media = EncodedMedia(torch.zeros(8, adapter.hidden_size), meta, 4, [], 0.0, 0.0)
    engine = PrefillEngine(PrefillConfig(), adapter)
    return engine.render(question_messages("what moves?"), media, GenerationConfig(max_new_tokens=1))


def test_a_tokenizer_that_splits_the_placeholder_is_the_servers_error(split_placeholder_checkpoint):
    with pytest.raises(RuntimeError) as failed:
        _render(split_placeholder_checkpoint)
    code, client_message = status_of(failed.value)
    assert code == grpc.StatusCode.INTERNAL
    assert client_message == "internal error; the server log has details"
    assert str(failed.value) == (
        f"the model's tokenizer gave 0 {PAD} tokens for the 8 that the prompt's media expanded to: "
        f"check that the checkpoint's tokenizer has {PAD} as one added token (tokenizer.json's "
        "added_tokens) with the id its processor and config give it"
    )


def test_the_same_request_renders_with_the_checkpoints_own_tokenizer(tiny_models):
    """The control: only the tokenizer files differ, and with the saved ones the prompt holds the
    grid's 8 placeholders."""
    request = _render(tiny_models["qwen2_vl"])
    assert int(request.prompt.visual_mask.sum()) == 8
