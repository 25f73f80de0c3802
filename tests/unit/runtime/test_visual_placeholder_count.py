"""A prompt whose expanded visual placeholders the tokenizer does not keep whole is the server's
error, not the client's (`visual_placeholders.checked_visual_mask`): the text parts' and the template's own
placeholders are refused before the expansion, so only the checkpoint (its tokenizer without the
placeholder as one added token) can make the count differ. Prefill answers INTERNAL, the message
(what the operator should check) for the server log; before, it was INVALID_ARGUMENT, telling the
client to change a request that nothing in it could fix.

The checkpoints are tiny Qwen2-VL's, Qwen3-VL's and LLaVA-OneVision's tokenizer, processor and config as
saved, their tokenizer files edited as a broken conversion would leave them: the video placeholder
(`<|video_pad|>`, `<video>`) neither an added token nor in the trained vocabulary, so the real
tokenizer splits it into byte pieces and has no id for it. LLaVA-OneVision's video
expansion writes one placeholder more than the grid's count (the closing newline prefill writes):
the count is checked before that last one is looked for, so none found is the same clear error,
not an IndexError."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import grpc
import pytest
import torch

from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.llava_onevision import LlavaOnevisionAdapter
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter
from epd.model_runtime.sampling import GenerationConfig
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.stages.contracts import EncodedMedia
from epd.stages.messages import question_messages
from epd.transport.errors import status_of


@dataclass(frozen=True)
class Family:
    adapter: type
    placeholder: str  # the video's
    grid_thw: tuple[int, int, int]  # a 2-frame video grid of the tiny checkpoint
    num_visual: int  # the grid's visual tokens
    expanded: int  # the placeholders its expansion writes


FAMILIES = {
    "qwen2_vl": Family(Qwen2VLAdapter, "<|video_pad|>", (2, 4, 4), 8, 8),
    "qwen3_vl": Family(Qwen3VLAdapter, "<|video_pad|>", (2, 4, 4), 8, 8),
    # 5 x 5 patches pooled to 3 x 3 per frame, then the closing newline
    "llava_onevision": Family(LlavaOnevisionAdapter, "<video>", (2, 5, 5), 18, 19),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    """Each family's tiny checkpoint as saved."""
    llava = build_checkpoint(
        tmp_path_factory.mktemp("llava_onevision") / "m", TinyVLMSpec(family="llava_onevision")
    )
    qwen3_vl = build_checkpoint(tmp_path_factory.mktemp("qwen3_vl") / "m", TinyVLMSpec(family="qwen3_vl"))
    return {"qwen2_vl": tiny_models["qwen2_vl"], "qwen3_vl": qwen3_vl, "llava_onevision": llava}


@pytest.fixture(scope="module")
def split_placeholder_checkpoints(checkpoints, tmp_path_factory):
    """Each family's files but its weights (a prompt needs none), its video placeholder no added token."""
    out = {}
    for family, source in checkpoints.items():
        pad = FAMILIES[family].placeholder
        target = tmp_path_factory.mktemp(f"split_placeholder_{family}")
        for path in source.iterdir():
            if path.suffix != ".safetensors":
                shutil.copy(path, target / path.name)
        tokenizer = json.loads((source / "tokenizer.json").read_text())
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != pad]
        # Out of the trained vocabulary too, as a broken conversion can leave it: no id at all, so a
        # mask read by the tokenizer's id would compare with None (the config's id is read).
        tokenizer["model"]["vocab"].pop(pad, None)
        (target / "tokenizer.json").write_text(json.dumps(tokenizer))
        config = json.loads((source / "tokenizer_config.json").read_text())
        config["extra_special_tokens"].remove(pad)
        (target / "tokenizer_config.json").write_text(json.dumps(config))
        out[family] = target
    return out


def _render(family, checkpoint):
    """The prefill engine's render of a question about the family's 2-frame video grid."""
    spec = FAMILIES[family]
    adapter = spec.adapter(str(checkpoint), ModelConfig(), set())  # prompts only, no weights
    assert adapter.num_visual_tokens(spec.grid_thw) == spec.num_visual
    meta = VisualMeta("video", spec.grid_thw, 1.0, spec.num_visual)
    features = torch.zeros(spec.num_visual, adapter.hidden_size)
    deepstack = [features] * adapter.num_deepstack_layers  # Qwen3-VL's per-layer features
    # 4 frames (2 pairs), 0.5 s apart: Qwen3-VL writes each pair's time into the prompt
    media = EncodedMedia(features, meta, 4, [0.0, 0.5, 1.0, 1.5], 0.0, 0.0, deepstack=deepstack)
    engine = PrefillEngine(PrefillConfig(), adapter)
    return engine.render(question_messages("what moves?"), media, GenerationConfig(max_new_tokens=1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tokenizer_that_splits_the_placeholder_is_the_servers_error(family, split_placeholder_checkpoints):
    spec = FAMILIES[family]
    with pytest.raises(RuntimeError) as failed:
        _render(family, split_placeholder_checkpoints[family])
    code, client_message = status_of(failed.value)
    assert code == grpc.StatusCode.INTERNAL
    assert client_message == "internal error; the server log has details"
    pad = spec.placeholder
    assert str(failed.value) == (
        f"the model's tokenizer gave 0 {pad} tokens for the {spec.expanded} that the prompt's media "
        f"expanded to: check that the checkpoint's tokenizer has {pad} as one added token (tokenizer.json's "
        "added_tokens) with the id its processor and config give it"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_request_renders_with_the_checkpoints_own_tokenizer(family, checkpoints):
    """The control: only the tokenizer files differ, and with the saved ones the prompt holds the
    grid's visual tokens (LLaVA-OneVision's closing newline not among them)."""
    request = _render(family, checkpoints[family])
    assert int(request.prompt.visual_mask.sum()) == FAMILIES[family].num_visual
