"""Helpers shared by the model-family adapter tests (`tests/integration/test_*_adapter.py`): the
question, greedy decoding loops, generate() references, and the checks that each one-part stage
adapter reads only its own part's tensors."""

from __future__ import annotations

from pathlib import Path

import safetensors
import torch

from epd.model_runtime.adapter import PrefillChunk, PrefillState, RenderOptions, VisionInputs, VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message, reference_inputs, source_timed_inputs
from epd.model_runtime.loader import _FAMILIES, check_model_dir, load_adapter
from tests.reference import decode_for_test

FAMILIES = list(_FAMILIES)
"""Every model type epd serves, in the loader's order: the every-family tests' parameters (a
family added to the loader is in them at once; `family_checkpoints` builds each)."""

QUESTION = "what colour is the moving square?"
MAX_NEW_TOKENS = 20
CASES = [("mp4", 8), ("mp4", 32), ("png", 1)]


QWEN3_5_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def build_qwen3_5_checkpoint(directory):
    """The tiny hybrid Qwen3.5 checkpoint (4 layers: linear, full, linear, full) the adapter and
    stack tests share."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    return build_checkpoint(directory, TinyVLMSpec(family="qwen3_5", num_hidden_layers=4))


# The tiny Qwen3-VL MoE text model: 4 experts, 2 per token, expert width 48 (so an expert's
# [2 * 48, 64] gate/up matrix is not square and the hub's transposed layout cannot pass unnoticed).
QWEN3_VL_MOE_TEXT = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}


def build_qwen3_vl_moe_checkpoint(directory):
    """The tiny Qwen3-VL MoE checkpoint the adapter and stack tests share: dense Qwen3-VL's tiny
    config (processor, tower with DeepStack, interleaved M-RoPE) with every language layer's MLP
    a sparse MoE block (`QWEN3_VL_MOE_TEXT`), saved as `build_checkpoint` saves the others."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from epd.model_runtime.tiny_model import TinyVLMSpec, build_model, build_processor
    from epd.model_runtime.tiny_parts import scale_weights

    spec = TinyVLMSpec(family="qwen3_vl")
    processor = build_processor(spec)
    tokenizer = processor.tokenizer
    dense = build_model(spec, tokenizer).config  # the sizes, token ids and rope of the dense tiny model
    text_keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rope_parameters",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
    )
    vision_keys = (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "out_hidden_size",
        "patch_size",
        "spatial_merge_size",
        "temporal_patch_size",
        "num_position_embeddings",
        "deepstack_visual_indexes",
    )
    config = Qwen3VLMoeConfig(
        text_config={
            **{k: getattr(dense.text_config, k) for k in text_keys},
            **QWEN3_VL_MOE_TEXT,
            "tie_word_embeddings": False,
        },
        vision_config={k: getattr(dense.vision_config, k) for k in vision_keys},
        image_token_id=dense.image_token_id,
        video_token_id=dense.video_token_id,
        vision_start_token_id=dense.vision_start_token_id,
        vision_end_token_id=dense.vision_end_token_id,
        tie_word_embeddings=False,
    )
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.eos_token_id, config.pad_token_id = eos, pad
    torch.manual_seed(spec.seed)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    scale_weights(model, spec)  # varied greedy output, router and experts included
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def family_checkpoints(tiny_models: dict[str, Path], root: Path) -> dict[str, Path]:
    """A tiny checkpoint of every family by name: conftest's two Qwen2 families (`tiny_models`)
    and the others built under `root`, each of its default `TinyVLMSpec` (Qwen3.5's two layers,
    linear and full, where its adapter tests' have four) and Qwen3-VL MoE's as its tests build it."""
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint

    out = dict(tiny_models)
    for family in FAMILIES:
        if family == "qwen3_vl_moe":
            out[family] = build_qwen3_vl_moe_checkpoint(root / family)
        elif family not in out:
            out[family] = build_checkpoint(root / family, TinyVLMSpec(family=family))
    return out


def conversation(video) -> list[dict]:
    return question_message(video, QUESTION)


def own_frames_inputs(processor, video):
    """The processor's own inputs for the test question on epd's frames as they are (its own frame
    sampling off, as vLLM calls it with frames it was given): LLaVA-OneVision's and InternVL's
    reference (`reference_inputs`)."""
    return reference_inputs(processor, video, conversation(video))


def qwen_processor_inputs(
    processor, video, metadata=None, messages: list[dict] | None = None, **template: bool
):
    """A Qwen3-style processor's own __call__ on the same frames (`source_timed_inputs`), for
    `messages` (default: `conversation(video)`)."""
    messages = conversation(video) if messages is None else messages
    return source_timed_inputs(processor, video, messages, metadata, **template)


def make_clip_over_qwen3_size_limit(directory: Path) -> Path:
    """A 224x192 H.264 clip, 4 s at 10 fps. The tiny Qwen3-VL video processor bounds a whole
    clip's t x h x w by size.longest_edge (128 * 128 * 64 px): 31 or 32 of these frames (1.3 Mpx)
    are over it, so it shrinks every frame (grid h x w 10 x 12, not 12 x 14); the 2-8 frames of
    one of the encoder's frame groups are not."""
    from tests.media import make_video

    return make_video(directory / "big.mp4", codec="h264", size=(224, 192), fps=10.0, seconds=4.0, gop=10)


def generate_on_whole_clip(
    whole, path: Path, num_frames: int, max_new_tokens: int = MAX_NEW_TOKENS
) -> tuple[int, int, list[int]]:
    """generate() given `num_frames` frames of `path` as one clip (the processor's own inputs):
    (prompt tokens, visual tokens, greedy tokens)."""
    model, processor = whole
    inputs = qwen_processor_inputs(processor, decode_for_test(path, num_frames))
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    prompt_ids = inputs["input_ids"]  # [1, L]
    num_visual = int((prompt_ids == model.config.video_token_id).sum())
    return prompt_ids.shape[1], num_visual, out[0, prompt_ids.shape[1] :].tolist()


def assert_pipeline_answers_as_generate(
    pipeline, whole, path: Path, num_frames: int, max_new_tokens: int = MAX_NEW_TOKENS
) -> None:
    """The embedded pipeline's answer on `num_frames` frames of `path` has generate()'s prompt
    length, visual token count and greedy tokens on the whole clip."""
    import asyncio

    from tests.embedded import ask_summary

    summary = asyncio.run(ask_summary(pipeline, path, QUESTION, num_frames, max_new_tokens))
    got = (summary.num_prompt_tokens, summary.num_visual_tokens, summary.token_ids)
    assert got == generate_on_whole_clip(whole, path, num_frames, max_new_tokens)


def visual_meta(adapter, inputs) -> VisualMeta:
    return VisualMeta(
        inputs.modality,
        inputs.grid_thw,
        inputs.second_per_grid_t,
        adapter.num_visual_tokens(inputs.grid_thw),
        inputs.group_timestamps_s,
    )


def load_video(media_files, media, num_frames):
    return decode_for_test(media_files[media], num_frames)


def greedy(language, state, cache=None) -> list[int]:
    """Greedy `decode_step`s after `state` (on `cache`, else its own decode cache), to EOS or
    MAX_NEW_TOKENS; the tokens."""
    if cache is None:
        cache = language.new_decode_cache(state.cache)
    logits, positions, tokens = state.last_logits, state.next_position_ids, []
    for _ in range(MAX_NEW_TOKENS):
        token = int(logits.argmax())
        tokens.append(token)
        if token in language.eos_token_ids:
            break
        logits = language.decode_step(token, positions, cache)
        positions = positions + 1  # every row, as the decode core does
    return tokens


def decode_alone(language, state, steps: int) -> torch.Tensor:
    """[steps, vocab]: the logits of `steps` greedy decode_step calls after `state`."""
    cache, positions, seen = language.new_decode_cache(state.cache), state.next_position_ids, []
    token = int(state.last_logits.argmax())
    for _ in range(steps):
        seen.append(language.decode_step(token, positions, cache))
        token, positions = int(seen[-1].argmax()), positions + 1
    return torch.stack(seen)


def checkpoint_keys(checkpoint, vision_key, language_key) -> tuple[set[str], set[str], set[str]]:
    """(every tensor name of the one-file checkpoint, the vision part's, the language part's), the
    parts by the family's own `vision_key` / `language_key`."""
    import safetensors

    from epd.model_runtime.hf_loading import safetensors_files

    root, files = safetensors_files(str(checkpoint))
    with safetensors.safe_open(str(root / files[0]), framework="pt") as f:
        keys = set(f.keys())
    return (
        keys,
        {k for k in keys if vision_key(k) is not None},
        {k for k in keys if language_key(k) is not None},
    )


def assert_batched_decode_equals_alone(language, states, steps: int = 6) -> None:
    """`steps` greedy `decode_batch` steps over the prefill `states` in one `BatchKv` give each row
    the argmax tokens, and the logits within 1e-4, of `decode_alone`."""
    alone = [decode_alone(language, state, steps) for state in states]
    batch = language.new_batch_kv()
    for state in states:
        batch.add(state.cache, max(s.num_prompt_tokens for s in states) + steps)
    tokens = [int(s.last_logits.argmax()) for s in states]
    positions = torch.stack([s.next_position_ids for s in states], dim=1)  # [4, B]
    batched = []
    for _ in range(steps):
        batched.append(language.decode_batch(tokens, positions, batch))  # [B, vocab]
        tokens, positions = batched[-1].argmax(-1).tolist(), positions + 1
    for row, expected in enumerate(alone):
        got = torch.stack([step[row] for step in batched])  # [steps, vocab]
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def generate_references(whole, media_files, processor_inputs, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """{(media, num_frames): generate()'s greedy tokens (at most `max_new_tokens`)} for every case."""
    model, processor = whole
    out = {}
    for media, num_frames in CASES:
        inputs = processor_inputs(processor, load_video(media_files, media, num_frames))
        with torch.inference_mode():
            generated = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        out[(media, num_frames)] = generated[0, inputs["input_ids"].shape[1] :].tolist()
    return out


def assert_epd_ask_equals_references(checkpoint, media_files, references, capsys) -> None:
    """`epd ask MEDIA QUESTION --model CHECKPOINT --json` (the CLI, embedded: the user's path from
    a checkpoint directory to an answer) gives generate()'s greedy tokens for 8 frames and the image."""
    import json

    from epd.cli.main import main

    for media, num_frames in (("mp4", 8), ("png", 1)):
        code = main(
            [
                "ask",
                str(media_files[media]),
                QUESTION,
                "--model",
                str(checkpoint),
                "--json",
                "--num-frames",
                str(num_frames),
                "--max-new-tokens",
                str(MAX_NEW_TOKENS),
            ]
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert json.loads(out.strip().splitlines()[-1])["token_ids"] == references[(media, num_frames)], media


def assert_reference_varies(ref: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> None:
    assert len(ref) == max_new_tokens, "the reference stopped early; the comparison would prove little"
    assert len(set(ref)) > 4, "the tiny model repeats one token; raise its weight scale"


def tensors_read(monkeypatch) -> list[str]:
    """Records every tensor the adapters read from safetensors (they read through `safe_open`)."""
    read: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._file = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self._inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return read


def load_each_part(adapter_cls, checkpoint, monkeypatch, vision_keys: set[str], language_keys: set[str]):
    """(vision-only adapter, language-only adapter), each checked to read exactly its keys."""
    read = tensors_read(monkeypatch)
    tower_only = adapter_cls(str(checkpoint), ModelConfig(), {"vision"})
    assert set(read) == vision_keys and tower_only.model is None
    read.clear()
    language_only = adapter_cls(str(checkpoint), ModelConfig(), {"language"})
    assert set(read) == language_keys and language_only.visual is None
    return tower_only, language_only


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def assert_qwen_parts_load_exactly(model, tower_only, language_only) -> None:
    """A Qwen-shaped model's tower ("model.visual.*") and the rest, loaded separately, equal the whole."""
    assert_same_state(tower_only.visual.state_dict(), model.model.visual.state_dict())
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("model.visual.")}
    assert_same_state(language_only.model.state_dict(), expected)


def load_stage_adapters(checkpoint, family: str, adapter_cls, language_stage: str):
    """The loader detects `family`; the encoder gets the tower only, `language_stage` the rest."""
    assert check_model_dir(str(checkpoint)) == family
    encoder = load_adapter(ModelConfig(model=str(checkpoint)), "encoder")
    language = load_adapter(ModelConfig(model=str(checkpoint)), language_stage)
    assert isinstance(encoder, adapter_cls) and encoder.visual is not None and encoder.model is None
    assert isinstance(language, adapter_cls) and language.model is not None and language.visual is None
    return encoder, language


def check_a_template_without_the_media_part_is_refused_as_such(adapter) -> None:
    """A given chat template (--chat-template, a trusted request's) may leave the media part out:
    `build_prompt` refuses the prompt saying the template rendered 0 placeholders and to use one
    that renders the part, not "send at most one part" (what 2 placeholders mean)."""
    import pytest

    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what moves?"}]}]
    visual = VisualMeta("video", (2, 4, 4), 1.0, 8)  # refused before the grid is read
    no_media = "{% for m in messages %}{{ m.content[-1].text }}{% endfor %}"
    with pytest.raises(
        ValueError, match="^the chat template rendered 0 video placeholders: it leaves"
    ) as refused:
        adapter.build_prompt(conversation, visual, RenderOptions(chat_template=no_media))
    assert "at most one" not in str(refused.value)


# -- checks shared by the families with 1-D positions (LLaVA-OneVision, InternVL) -------------------


def one_dim_prompt_and_embeds(vision, language, media_files, media, num_frames):
    """(the language adapter's prompt, the encoder adapter's embeddings) for the test question."""
    video = load_video(media_files, media, num_frames)
    inputs = vision.preprocess(video)
    return language.build_prompt(conversation(video), visual_meta(vision, inputs)), vision.encode(inputs)


def assert_frame_groups_encode_as_the_whole(vision, media_files) -> None:
    """The encoder encodes `frames_per_group` frames at a time and concatenates: 2-frame groups of
    8 frames give the whole clip's embeddings, and `encode_batch` of a group, the image and the
    clip gives each one's `encode`."""
    video = load_video(media_files, "mp4", 8)
    inputs = vision.preprocess(video)
    whole = vision.encode(inputs)
    _, side, _ = inputs.grid_thw
    groups = [
        VisionInputs("video", inputs.pixel_values[i : i + 2], (2, side, side), inputs.second_per_grid_t)
        for i in range(0, 8, 2)
    ]
    assert torch.allclose(torch.cat([vision.encode(g) for g in groups]), whole, atol=1e-5)
    image = vision.preprocess(load_video(media_files, "png", 1))
    batched = vision.encode_batch([groups[0], image, inputs])
    alone = [vision.encode(groups[0]), vision.encode(image), whole]
    assert [b.shape for b in batched] == [a.shape for a in alone]
    assert all(torch.allclose(b, a, atol=1e-5) for b, a in zip(batched, alone, strict=True))


def assert_chunked_and_batched_prefill_equal_alone(vision, language, media_files, last_cut: int) -> None:
    """The 8-frame video's and the image's prompts in one padded `prefill_chunks` forward, and the
    video's in three chunks (cut at token 30 and `last_cut` tokens after its last visual token),
    equal `prefill` of each alone."""
    (p1, e1), (p2, e2) = (
        one_dim_prompt_and_embeds(vision, language, media_files, m, n) for m, n in (("mp4", 8), ("png", 1))
    )
    alone = [language.prefill(p, e) for p, e in ((p1, e1), (p2, e2))]
    rows = language.prefill_chunks(
        [PrefillChunk(p1, e1, 0, p1.num_tokens), PrefillChunk(p2, e2, 0, p2.num_tokens)]
    )
    for got, want in zip(rows, alone, strict=True):
        assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)
        kv = language.chunk_cache_to_kv(got.cache)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(kv.keys, want.cache.keys, strict=True))
    cuts = [0, 30, int(p1.visual_mask.nonzero()[-1]) + last_cut, p1.num_tokens]
    cache = None
    for start, end in zip(cuts, cuts[1:], strict=False):
        (result,) = language.prefill_chunks([PrefillChunk(p1, e1, start, end, cache)])
        cache = result.cache
    assert torch.allclose(result.last_logits, alone[0].last_logits, atol=1e-4)
    chunked = PrefillState(
        language.chunk_cache_to_kv(cache), result.last_logits, alone[0].next_position_ids, p1.num_tokens
    )
    assert greedy(language, chunked) == greedy(language, alone[0])


def assert_batched_decode_of_three_prompts_equals_alone(vision, language, media_files) -> None:
    """Prompts of different lengths (8 frames, the image, 32 frames) decoded in one batch."""
    states = [
        language.prefill(*one_dim_prompt_and_embeds(vision, language, media_files, media, n))
        for media, n in (("mp4", 8), ("png", 1), ("mp4", 32))
    ]
    assert language.kv_bytes_per_token * states[0].num_prompt_tokens == states[0].cache.num_bytes
    assert_batched_decode_equals_alone(language, states)


def assert_layerwise_pruning_refused_and_sizes_described(language) -> None:
    """The prefill drop, KV compression and decode eviction need `layerwise_prefill` /
    `capture_queries`, which a family without them refuses, naming its adapter; its sizes are
    still described (what budgets and FLOP counts read)."""
    import pytest

    from epd.model_runtime.adapter import UnsupportedByFamily

    name = type(language).__name__
    dims = language.text_dims
    c = language.hf_config.text_config
    assert (dims.num_layers, dims.hidden_size, dims.num_kv_heads) == (
        c.num_hidden_layers,
        c.hidden_size,
        c.num_key_value_heads,
    )
    assert language.kv_bytes_per_token == 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * 4
    embeds = language.embed(torch.tensor([[1, 2, 3]]))
    assert embeds.shape == (1, 3, dims.hidden_size)
    with pytest.raises(UnsupportedByFamily, match=f"{name} cannot run its decoder layer by layer"):
        language.layerwise_prefill(embeds, torch.arange(3).view(1, 1, 3).expand(4, 1, 3))
    with pytest.raises(UnsupportedByFamily, match=name):
        language.capture_queries([0], torch.tensor([2]))


def assert_three_services_equal_references(
    checkpoint, media_files, references, logs: Path, tokens_per_frame: int
) -> None:
    """The unchanged engines serve the family: encoder (default 2-frame groups), prefill and
    decode processes, each loading only its part, answer every case as generate() does, a video
    with `tokens_per_frame` visual tokens a frame."""
    from epd.client import EpdClient
    from tests.stack import Stack

    with Stack(checkpoint, logs) as stack:
        with EpdClient(stack.gateway) as client:
            for media, num_frames in CASES:
                result = client.ask(
                    media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS
                )
                assert result.token_ids == references[(media, num_frames)], (media, num_frames)
                if media == "mp4":
                    assert result.num_visual_tokens == tokens_per_frame * num_frames
