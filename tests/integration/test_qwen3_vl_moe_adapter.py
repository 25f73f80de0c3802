"""Qwen3-VL MoE through `Qwen3VLMoeAdapter` split in one process, as `test_qwen3_vl_adapter.py`
checks dense Qwen3-VL: the loader detects model_type qwen3_vl_moe, the encoder's adapter (tower
only) -> `encode_features`, the language adapter (router and experts included, no tower) ->
`build_prompt` + `prefill` + greedy `decode_step`s equals `model.generate(do_sample=False)` token
for token for 8 and 32 frames and an image; dropping the DeepStack features changes the answer.
Batched and chunked prefill rows and batched decode equal each request alone (routing is per
token); experts stored in the hub's transposed layout load as transformers loads them; pruning is
declared as for dense Qwen3-VL."""

from __future__ import annotations

import shutil

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from epd.model_runtime.adapter import PrefillChunk, UnsupportedByFamily
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import language_key, vision_key
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.loader import SUPPORTED
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter
from epd.model_runtime.qwen3_vl_moe import Qwen3VLMoeAdapter
from epd.stages.contracts import refuse_unsupported_pruning
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig
from tests.families import (
    CASES,
    QWEN3_VL_MOE_TEXT,
    assert_batched_decode_equals_alone,
    assert_epd_ask_equals_references,
    assert_qwen_parts_load_exactly,
    assert_reference_varies,
    build_qwen3_vl_moe_checkpoint,
    checkpoint_keys,
    conversation,
    generate_references,
    greedy,
    load_each_part,
    load_stage_adapters,
    load_video,
    qwen_processor_inputs,
    visual_meta,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_vl_moe_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe") / "m")


@pytest.fixture(scope="module")
def adapters(checkpoint):
    """(encoder's adapter: tower only, prefill's: language only), both through the loader."""
    return load_stage_adapters(checkpoint, "qwen3_vl_moe", Qwen3VLMoeAdapter, "prefill")


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, qwen_processor_inputs)


def _prefill(adapters, video, drop_deepstack=False):
    """Encoder adapter -> language adapter: (prompt, features, PrefillState)."""
    vision, language = adapters
    inputs = vision.preprocess(video)
    features = vision.encode_features(inputs)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    if drop_deepstack:
        return prompt, features, language.prefill(prompt, features.embeds, None)
    return prompt, features, language.prefill_features(prompt, features)


def test_the_loader_names_the_family_and_the_dense_class_refuses_it(checkpoint, adapters):
    assert "qwen3_vl_moe" in SUPPORTED
    vision, language = adapters
    assert vision.family == language.family == "qwen3_vl_moe"
    with pytest.raises(ValueError, match="Qwen3VLAdapter loads model_type qwen3_vl, not 'qwen3_vl_moe'"):
        Qwen3VLAdapter(str(checkpoint), ModelConfig(), set())
    layers = language.language_model.layers
    assert all(type(layer.mlp).__name__ == "Qwen3VLMoeTextSparseMoeBlock" for layer in layers), "not MoE"
    assert vision.num_deepstack_layers == 2


@pytest.mark.parametrize("media,num_frames", CASES)
def test_reference_output_varies(references, media, num_frames):
    assert_reference_varies(references[(media, num_frames)])


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_equals_generate(adapters, media_files, references, media, num_frames):
    _, _, state = _prefill(adapters, load_video(media_files, media, num_frames))
    assert greedy(adapters[1], state) == references[(media, num_frames)]


@pytest.mark.parametrize("media,num_frames", CASES)
def test_dropping_the_deepstack_features_changes_the_answer(
    adapters, media_files, references, media, num_frames
):
    """Negative control: the same split without DeepStack no longer equals generate()."""
    video = load_video(media_files, media, num_frames)
    _, _, state = _prefill(adapters, video)
    _, _, dropped = _prefill(adapters, video, drop_deepstack=True)
    assert not torch.allclose(state.last_logits, dropped.last_logits, atol=1e-3)
    assert greedy(adapters[1], dropped) != references[(media, num_frames)]


def test_batched_and_chunked_prefill_and_batched_decode_equal_each_request_alone(adapters, media_files):
    """Padded prefill rows (padding tokens are routed too, but only to their own rows' outputs),
    a prompt continued chunk by chunk through its visual tokens, and one decode batch equal each
    request alone: same argmax, logits and KV within float rounding."""
    language = adapters[1]
    alone = [_prefill(adapters, load_video(media_files, m, n)) for m, n in CASES]
    rows = [PrefillChunk(p, f.embeds, 0, p.num_tokens, deepstack=f.deepstack) for p, f, _ in alone]
    for result, (_, _, ref) in zip(language.prefill_chunks(rows), alone, strict=True):
        assert int(result.last_logits.argmax()) == int(ref.last_logits.argmax())
        torch.testing.assert_close(result.last_logits, ref.last_logits, rtol=1e-4, atol=1e-4)
        kv = language.chunk_cache_to_kv(result.cache)
        for k, k_ref in zip(kv.keys + kv.values, ref.cache.keys + ref.cache.values, strict=True):
            torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
    prompt, features, ref = alone[1]  # 32 frames: chunks of 50 tokens cut through the visual ones
    cache = None
    for start in range(0, prompt.num_tokens, 50):
        end = min(start + 50, prompt.num_tokens)
        row = PrefillChunk(prompt, features.embeds, start, end, cache, deepstack=features.deepstack)
        (result,) = language.prefill_chunks([row])
        cache = result.cache
    torch.testing.assert_close(result.last_logits, ref.last_logits, rtol=1e-4, atol=1e-4)

    # 8 frames and the image: prompts of different lengths
    assert_batched_decode_equals_alone(language, [alone[0][2], alone[2][2]])


def test_each_one_part_adapter_reads_only_its_own_tensors_and_loads_them_exactly(
    checkpoint, whole, monkeypatch
):
    model, _ = whole
    keys, vision_keys, language_keys = checkpoint_keys(checkpoint, vision_key, language_key)
    assert vision_keys and not vision_keys & language_keys and vision_keys | language_keys == keys
    assert any(k.endswith("mlp.gate.weight") for k in language_keys), "the routers"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in language_keys), "the experts"
    tower_only, language_only = load_each_part(
        Qwen3VLMoeAdapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    assert_qwen_parts_load_exactly(model, tower_only, language_only)


def test_experts_in_the_hubs_layout_load_as_transformers_loads_them(checkpoint, whole, tmp_path):
    """The hub stores an expert tensor as [experts, in, out]; `save_pretrained` writes the model's
    [experts, out, in]. The same checkpoint re-saved in the hub's layout loads, part by part,
    into the same language model transformers' own loader builds from either."""
    model, _ = whole
    hub = tmp_path / "hub_layout"
    shutil.copytree(checkpoint, hub)
    with safetensors.safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    experts = [k for k in state if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    for key in experts:
        state[key] = state[key].transpose(1, 2).contiguous()
    gate_up = state["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    # [E, in, out], not square
    assert gate_up.shape[1:] == (64, 2 * QWEN3_VL_MOE_TEXT["moe_intermediate_size"])
    save_file(state, str(hub / "model.safetensors"), metadata={"format": "pt"})

    language_only = Qwen3VLMoeAdapter(str(hub), ModelConfig(), {"language"})
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("model.visual.")}
    got = language_only.model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    from_hub, _ = whole_model(hub)  # transformers converts the hub's layout to the same weights
    assert all(torch.equal(from_hub.state_dict()[k], v) for k, v in expected.items())


def test_pruning_is_declared_as_for_dense_qwen3_vl(adapters):
    language = adapters[1]
    assert Qwen3VLMoeAdapter.supported_pruning == Qwen3VLAdapter.supported_pruning
    assert Qwen3VLMoeAdapter.pruning_refusal_reason == Qwen3VLAdapter.pruning_refusal_reason
    refuse_unsupported_pruning(  # the encoder stages it supports pass
        language.family,
        language.supported_pruning,
        language.pruning_refusal_reason,
        PruningConfig(temporal_drop=True, key_token_ratio=0.1),
    )
    with pytest.raises(InvalidRequest, match=r"prefill_drop \(prefill stage\).*qwen3_vl_moe"):
        refuse_unsupported_pruning(
            language.family,
            language.supported_pruning,
            language.pruning_refusal_reason,
            PruningConfig(prefill_drop=True, prefill_keep_ratio=0.5),
        )
    with pytest.raises(UnsupportedByFamily, match=r"Qwen3-VL MoE \(qwen3_vl_moe\).*prefill drop"):
        language.layerwise_prefill(
            torch.zeros(1, 2, language.hidden_size), torch.zeros(4, 1, 2, dtype=torch.long)
        )
    # The prefill FLOPs estimate's MLP width: the top-k experts a token runs through.
    assert language.text_dims.intermediate_size == (
        QWEN3_VL_MOE_TEXT["num_experts_per_tok"] * QWEN3_VL_MOE_TEXT["moe_intermediate_size"]
    )


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)
