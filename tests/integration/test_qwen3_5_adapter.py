"""Qwen3.5 (hybrid Gated DeltaNet + full attention) through `Qwen3_5Adapter` split in one process:
the encoder's adapter (tower only) -> `encode`, the language adapter -> `build_prompt` + `prefill`,
the cache through its wire form (`KvCache.named_tensors()` -> `from_named_tensors()`) ->
`new_decode_cache` -> a greedy `decode_step` loop, equals `model.generate(do_sample=False)` token for
token on a tiny checkpoint of the real transformers classes, for 8 and 32 frames and an image. The
linear layers' conv and recurrent states cross the boundary (zeroing them changes the answer;
losing them is refused); batched decode equals decoding alone; KV budget and pruning refusal;
each one-part adapter reads only its own part's tensors.

Chunked prefill (`prefill_chunks`, chunks of 1, 7 and 64 tokens, boundaries inside the visual
tokens) carries the linear states from chunk to chunk and equals generate() (dropping them between
chunks changes the answer); several prompts in one right-padded forward equal each prompt alone
and generate() (without the neutral padding, the shorter rows' states and answers go wrong); the
prefill core chunking three requests at once equals generate()."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.adapter import PrefillChunk, PrefillState, VisualFeatures
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_loading import language_key, vision_key
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.qwen3_5 import Qwen3_5Adapter
from tests.families import (
    CASES,
    MAX_NEW_TOKENS,
    QUESTION,
    QWEN3_5_LAYER_TYPES,
    assert_epd_ask_equals_references,
    assert_qwen_parts_load_exactly,
    assert_reference_varies,
    build_qwen3_5_checkpoint,
    checkpoint_keys,
    conversation,
    decode_alone,
    generate_references,
    greedy,
    load_each_part,
    load_stage_adapters,
    load_video,
    visual_meta,
)
from tests.families import qwen_processor_inputs as _processor_inputs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5") / "m")


@pytest.fixture(scope="module")
def vision(checkpoint):
    return Qwen3_5Adapter(str(checkpoint), ModelConfig(), {"vision"})  # the encoder's


@pytest.fixture(scope="module")
def language(checkpoint):
    return Qwen3_5Adapter(str(checkpoint), ModelConfig(), {"language"})  # prefill's and decode's


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


def _over_the_wire(cache: KvCache) -> KvCache:
    """What the decode pull reassembles: the named tensors, copied, by name."""
    return KvCache.from_named_tensors({name: t.clone() for name, t in cache.named_tensors()})


def _prefill(vision, language, video):
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    return language.prefill_features(prompt, vision.encode_features(inputs))


def _split(vision, language, video, zero_linear_states=False):
    """Encoder adapter -> language adapter -> wire -> decode, greedy; returns the tokens."""
    state = _prefill(vision, language, video)
    wire = _over_the_wire(state.cache)
    if zero_linear_states:
        wire.conv_states = {i: torch.zeros_like(s) for i, s in wire.conv_states.items()}
        wire.recurrent_states = {i: torch.zeros_like(s) for i, s in wire.recurrent_states.items()}
    return greedy(language, state, language.new_decode_cache(wire))


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, _processor_inputs)


def test_the_tiny_model_is_hybrid_without_deepstack(language, whole):
    model, _ = whole
    assert language.layer_types == QWEN3_5_LAYER_TYPES == model.config.text_config.layer_types
    assert language.attention_layers == [1, 3] and language.linear_layers == [0, 2]
    assert language.num_deepstack_layers == 0
    assert not hasattr(model.model.visual, "deepstack_merger_list")


@pytest.mark.parametrize("media,num_frames", CASES)
def test_reference_output_varies(references, media, num_frames):
    assert_reference_varies(references[(media, num_frames)])


@pytest.mark.parametrize("media,num_frames", CASES)
def test_prompt_pixels_and_positions_are_the_processors_and_generates(
    vision, language, whole, media_files, media, num_frames
):
    model, processor = whole
    video = load_video(media_files, media, num_frames)
    ref = _processor_inputs(processor, video)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))

    assert torch.equal(prompt.input_ids, ref["input_ids"])
    text = processor.tokenizer.decode(prompt.input_ids[0])
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # the template's own generation prompt
    pixels, grid = (
        ("pixel_values", "image_grid_thw") if video.is_image else ("pixel_values_videos", "video_grid_thw")
    )
    assert torch.equal(inputs.pixel_values, ref[pixels]) and inputs.grid_thw == tuple(ref[grid][0].tolist())
    expected = model._prepare_position_ids_for_generation(ref["input_ids"], dict(ref))  # what generate() uses
    assert torch.equal(prompt.position_ids, expected)
    if not video.is_image:
        assert text.count(" seconds>") == inputs.grid_thw[0] == num_frames // 2


@pytest.mark.parametrize("media,num_frames", CASES)
def test_in_process_split_through_the_wire_equals_generate(
    vision, language, media_files, references, media, num_frames
):
    assert (
        _split(vision, language, load_video(media_files, media, num_frames))
        == references[(media, num_frames)]
    )


@pytest.mark.parametrize("media,num_frames", [("mp4", 8), ("png", 1)])
def test_zeroing_the_linear_states_on_the_way_changes_the_answer(
    vision, language, media_files, references, media, num_frames
):
    video = load_video(media_files, media, num_frames)
    assert _split(vision, language, video, zero_linear_states=True) != references[(media, num_frames)]


def test_the_cache_carries_attention_kv_and_fixed_size_linear_states(vision, language, media_files):
    short = _prefill(vision, language, load_video(media_files, "png", 1)).cache
    long = _prefill(vision, language, load_video(media_files, "mp4", 32)).cache
    for cache in (short, long):
        assert cache.layer_ids == [1, 3] and cache.linear_layers == [0, 2]
        assert all(s.dtype == torch.float32 for s in cache.recurrent_states.values())
        assert cache.kv_num_bytes == language.kv_bytes_per_token * cache.num_cached_tokens
        assert cache.linear_state_num_bytes == language.linear_state_bytes
        assert cache.num_bytes == cache.kv_num_bytes + cache.linear_state_num_bytes
    assert long.num_cached_tokens > short.num_cached_tokens  # KV grows with the prompt, states do not
    assert long.linear_state_num_bytes == short.linear_state_num_bytes
    names = [name for name, _ in long.named_tensors()]
    assert names == [
        "layer.0.conv",
        "layer.0.recurrent",
        "layer.1.key",
        "layer.1.value",
        "layer.2.conv",
        "layer.2.recurrent",
        "layer.3.key",
        "layer.3.value",
    ]
    back = _over_the_wire(long)
    assert back.layer_ids == [1, 3] and back.num_bytes == long.num_bytes
    assert back.num_cached_tokens == long.num_cached_tokens
    narrow = long.cast(torch.bfloat16)  # PruningConfig.kv_dtype: recurrent states stay float32
    assert all(k.dtype == torch.bfloat16 for k in narrow.keys)
    assert all(s.dtype == torch.bfloat16 for s in narrow.conv_states.values())
    assert all(s.dtype == torch.float32 for s in narrow.recurrent_states.values())
    assert language.new_decode_cache(narrow).get_seq_length() == long.num_cached_tokens


def test_a_cache_without_its_linear_states_is_refused(vision, language, media_files):
    cache = _prefill(vision, language, load_video(media_files, "png", 1)).cache
    named = dict(cache.named_tensors())
    del named["layer.2.recurrent"]
    with pytest.raises(ValueError, match="missing tensor 'layer.2.recurrent'"):
        KvCache.from_named_tensors(named)
    keys_only = KvCache(cache.keys, cache.values, cache.attention_layers)  # e.g. rebuilt from keys alone
    with pytest.raises(ValueError, match="conv states for layers \\[\\]"):
        language.new_decode_cache(keys_only)
    plain = KvCache(cache.keys, cache.values)  # an attention-only model's cache
    with pytest.raises(ValueError, match="attention layers are \\[1, 3\\]"):
        language.new_decode_cache(plain)


def test_pruning_and_deepstack_are_refused(vision, language, media_files):
    with pytest.raises(ValueError, match="Qwen3.5 .* supports no token pruning"):
        language.text_dims  # noqa: B018 - what every pruning stage asks for first
    with pytest.raises(ValueError, match="Qwen3.5 .* supports no token pruning"):
        language.num_layers  # noqa: B018
    video = load_video(media_files, "png", 1)
    inputs = vision.preprocess(video)
    embeds = vision.encode(inputs)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    with pytest.raises(ValueError, match="no DeepStack layers"):
        language.prefill_features(prompt, VisualFeatures(embeds, [embeds]))


def test_batched_decode_equals_decoding_each_request_alone_through_joins_and_leaves(
    vision, language, media_files
):
    """Two requests of different lengths share decode steps; the first leaves mid-way (the
    second's slot and linear states move into row 0) and the second goes on alone in the batch."""
    states = [_prefill(vision, language, load_video(media_files, m, n)) for m, n in (("mp4", 8), ("png", 1))]
    together, after = 4, 3
    alone = [decode_alone(language, state, together + after) for state in states]

    assert language.supports_batched_decode
    batch = language.new_batch_kv()
    columns = max(s.num_prompt_tokens for s in states) + together + after + 1
    for state in states:
        batch.add(_over_the_wire(state.cache), columns)
    tokens = [int(s.last_logits.argmax()) for s in states]
    positions = torch.stack([s.next_position_ids for s in states], dim=1)  # [4, B]
    got: list[list[torch.Tensor]] = [[], []]
    for _ in range(together):
        logits = language.decode_batch(tokens, positions, batch)  # [B, vocab]
        for row in range(2):
            got[row].append(logits[row])
        tokens, positions = logits.argmax(-1).tolist(), positions + 1
    row_cache = batch.row_cache(1)
    assert row_cache.linear_layers == [0, 2] and row_cache.layer_ids == [1, 3]
    assert batch.remove(0) == 1  # the second request moves into row 0
    tokens, positions = tokens[1:], positions[:, 1:]
    for _ in range(after):
        logits = language.decode_batch(tokens, positions, batch)
        got[1].append(logits[0])
        tokens, positions = logits.argmax(-1).tolist(), positions + 1
    batch.remove(0)
    assert batch.num_rows == 0 and batch.num_bytes == 0
    for row, expected in enumerate(alone):
        seen = torch.stack(got[row])
        assert torch.equal(seen.argmax(-1), expected[: len(seen)].argmax(-1))
        assert torch.allclose(seen, expected[: len(seen)], atol=1e-4), (
            (seen - expected[: len(seen)]).abs().max()
        )


def test_a_batch_refuses_a_cache_without_linear_states(vision, language, media_files):
    state = _prefill(vision, language, load_video(media_files, "png", 1))
    keys_only = KvCache(state.cache.keys, state.cache.values, state.cache.attention_layers)
    with pytest.raises(ValueError, match="linear-attention states of layers \\[0, 2\\]"):
        language.new_batch_kv().add(keys_only, state.num_prompt_tokens + 4)


@pytest.mark.parametrize("running", [0, 1], ids=["empty batch", "beside a running row"])
def test_a_batch_refuses_another_models_linear_states_and_keeps_its_rows(
    vision, language, media_files, running
):
    """A cache whose attention KV fits but whose linear states are another model's (one conv
    channel short) is refused before any row changes: a slot row without its states failed every
    later step of the batch, for every request, for good."""
    state = _prefill(vision, language, load_video(media_files, "png", 1))
    columns = state.num_prompt_tokens + 4
    batch = language.new_batch_kv()
    for _ in range(running):
        batch.add(_over_the_wire(state.cache), columns)
    wrong = _over_the_wire(state.cache)
    wrong.conv_states[2] = wrong.conv_states[2][:, :-1]
    with pytest.raises(
        ValueError, match="linear layer 2's states have shapes .* prefill and decode serve different models"
    ):
        batch.add(wrong, columns)
    conv = batch.linear[0].conv_states[0]  # type: ignore[attr-defined]
    assert batch.num_rows == running and (conv is None if not running else conv.shape[0] == running)
    if running:  # the running row still steps, alone in the batch
        logits = language.decode_batch(
            [int(state.last_logits.argmax())], state.next_position_ids[:, None], batch
        )
        assert logits.shape[0] == 1
    batch.add(_over_the_wire(state.cache), columns)  # and a fitting cache still joins
    assert batch.num_rows == running + 1


def test_each_one_part_adapter_reads_only_its_own_tensors_and_loads_them_exactly(
    checkpoint, whole, monkeypatch
):
    model, _ = whole
    keys, vision_keys, language_keys = checkpoint_keys(checkpoint, vision_key, language_key)
    assert vision_keys and language_keys and not vision_keys & language_keys
    assert vision_keys | language_keys == keys
    assert any("linear_attn" in k for k in language_keys)

    tower_only, language_only = load_each_part(
        Qwen3_5Adapter, checkpoint, monkeypatch, vision_keys, language_keys
    )
    assert_qwen_parts_load_exactly(model, tower_only, language_only)


def test_the_loader_detects_qwen3_5_and_loads_each_stages_part(checkpoint):
    load_stage_adapters(checkpoint, "qwen3_5", Qwen3_5Adapter, "decode")


@pytest.fixture(scope="module")
def pipeline(checkpoint):
    from epd.gateway.embedded import build_embedded_pipeline

    with build_embedded_pipeline(ModelConfig(model=str(checkpoint))) as pipeline:
        yield pipeline


def _ask(pipeline, media_files, cases, pruning=None):
    """The pipeline's summaries of several questions asked at once (their decoding shares steps)."""
    import asyncio

    from epd.gateway.ask_types import AskRequest, AskSummary
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.contracts import MediaInput
    from epd.stages.messages import question_messages
    from epd.token_pruning import PruningConfig
    from epd.video.types import SamplingOptions

    async def one(media, num_frames):
        request = AskRequest(
            messages=question_messages(QUESTION),
            media=MediaInput(media_files[media].read_bytes()),
            sampling=SamplingOptions(num_frames=num_frames),
            generation=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
            pruning=pruning or PruningConfig(),
        )
        async for item in pipeline.ask(request):
            if isinstance(item, AskSummary):
                return item
        raise AssertionError("no summary")

    async def run():
        return await asyncio.gather(*(one(m, n) for m, n in cases))

    return asyncio.run(run())


def test_the_stages_in_one_process_equal_generate_and_refuse_pruning(
    pipeline, language, media_files, references
):
    """The real encoder, prefill and decode stages, two requests at once; the cache they hand
    over counts the linear states beside the KV."""
    from epd.stages.errors import InvalidRequest
    from epd.token_pruning import PruningConfig

    cases = [("mp4", 8), ("png", 1)]
    for (media, num_frames), summary in zip(cases, _ask(pipeline, media_files, cases), strict=True):
        assert summary.token_ids == references[(media, num_frames)]
        kv = language.kv_bytes_per_token * summary.num_prompt_tokens
        assert summary.kv_num_bytes == kv + language.linear_state_bytes
    with pytest.raises(InvalidRequest, match="is not supported for model family qwen3_5"):
        _ask(pipeline, media_files, [("mp4", 8)], PruningConfig.from_preset("light"))


# -- chunked and batched prefill --------------------------------------------------------------

# (media, frames, chunk tokens): each prompt has a chunk boundary inside its visual tokens (the
# 8-frame prompt's visual tokens are 17..103, the 32-frame one's 17..403, the image's 5..10);
# chunks of 1 token take the model's one-token path (the decode kernels) from the second on.
CHUNK_CASES = [("mp4", 8, 7), ("mp4", 8, 64), ("mp4", 32, 7), ("mp4", 32, 64), ("png", 1, 7), ("png", 1, 1)]


def _prompt_and_embeds(vision, language, media_files, media, num_frames):
    video = load_video(media_files, media, num_frames)
    inputs = vision.preprocess(video)
    prompt = language.build_prompt(conversation(video), visual_meta(vision, inputs))
    return prompt, vision.encode(inputs)


def _state(language, prompt, cache, last_logits) -> PrefillState:
    """A finished row as the prefill core hands it on (`chunk_cache_to_kv`, positions after the prompt)."""
    kv = language.chunk_cache_to_kv(cache)
    return PrefillState(kv, last_logits, prompt.position_ids[:, 0, -1] + 1, prompt.num_tokens)


def _prefill_in_chunks(language, prompt, embeds, chunk_tokens, drop_linear_states=False) -> PrefillState:
    """One `prefill_chunks` call per chunk, each continuing the cache the last one returned.
    drop_linear_states: every linear layer starts each chunk from zero states, as a model that
    ignored its cache for a multi-token forward would (the negative control)."""
    cache, starts = None, range(0, prompt.num_tokens, chunk_tokens)
    for start in starts:
        if drop_linear_states and cache is not None:
            with torch.inference_mode():  # the cache's tensors are inference tensors
                for i in language.linear_layers:
                    cache.layers[i].reset()  # zero states, no previous state: the next chunk starts afresh
        row = PrefillChunk(prompt, embeds, start, min(start + chunk_tokens, prompt.num_tokens), cache)
        [result] = language.prefill_chunks([row])
        cache = result.cache
    return _state(language, prompt, cache, result.last_logits)


def _assert_same_prefill(got: PrefillState, expected: PrefillState, rel: float = 1e-4) -> None:
    """Logits, attention KV and both linear states equal up to float rounding: within `rel` of each
    tensor's largest magnitude (at least 1). Chunks and padded batches group the same sums
    differently; through this tiny model's large weights (std 0.3, keys up to ~10) float32 rounding
    reaches ~1e-5 of that scale. The negative controls differ by more than 1e-2."""
    assert torch.equal(got.next_position_ids, expected.next_position_ids)
    assert int(got.last_logits.argmax()) == int(expected.last_logits.argmax())
    pairs = [(got.last_logits, expected.last_logits)]
    pairs += list(
        zip(got.cache.keys + got.cache.values, expected.cache.keys + expected.cache.values, strict=True)
    )
    for states in ("conv_states", "recurrent_states"):
        a, b = getattr(got.cache, states), getattr(expected.cache, states)
        assert a.keys() == b.keys()
        pairs += [(a[i], b[i]) for i in a]
    for a, b in pairs:
        assert a.shape == b.shape and a.dtype == b.dtype
        err, scale = float((a - b).abs().max()), max(1.0, float(b.abs().max()))
        assert err <= rel * scale, f"{tuple(a.shape)}: differs by {err:.2e}, scale {scale:.2f}"


def test_qwen3_5_prefills_in_chunks():
    assert Qwen3_5Adapter.supports_chunked_prefill  # the prefill core keeps --prefill-chunk-tokens


@pytest.mark.parametrize("media,num_frames,chunk_tokens", CHUNK_CASES)
def test_chunked_prefill_then_decode_equals_generate(
    vision, language, media_files, references, media, num_frames, chunk_tokens
):
    prompt, embeds = _prompt_and_embeds(vision, language, media_files, media, num_frames)
    visual = prompt.visual_mask.nonzero()[:, 0]
    starts = range(chunk_tokens, prompt.num_tokens, chunk_tokens)
    assert any(visual[0] < s <= visual[-1] for s in starts), "no chunk boundary inside the visual tokens"

    chunked = _prefill_in_chunks(language, prompt, embeds, chunk_tokens)
    _assert_same_prefill(chunked, language.prefill(prompt, embeds))
    cache = language.new_decode_cache(_over_the_wire(chunked.cache))
    assert greedy(language, chunked, cache) == references[(media, num_frames)]


@pytest.mark.parametrize("media,num_frames,chunk_tokens", [("mp4", 8, 64), ("png", 1, 7)])
def test_dropping_the_linear_states_between_chunks_changes_the_answer(
    vision, language, media_files, references, media, num_frames, chunk_tokens
):
    prompt, embeds = _prompt_and_embeds(vision, language, media_files, media, num_frames)
    dropped = _prefill_in_chunks(language, prompt, embeds, chunk_tokens, drop_linear_states=True)
    whole = language.prefill(prompt, embeds)
    assert not torch.allclose(dropped.last_logits, whole.last_logits, atol=1e-2)
    assert greedy(language, dropped) != references[(media, num_frames)]


def _batched_then_chunked(language, prompts, chunk_tokens, neutral_padding=True) -> list[PrefillState]:
    """Step 1: every prompt from token 0 in one right-padded forward, whole or (longer than
    `chunk_tokens`) its first chunk; then each unfinished one continues in chunks, as the
    prefill core schedules them."""
    rows = [PrefillChunk(p, e, 0, min(p.num_tokens, chunk_tokens)) for p, e in prompts]
    with torch.inference_mode():  # as `prefill_chunks` runs it
        results = language._prefill_padded(rows, neutral_padding=neutral_padding)
    states = []
    for (prompt, embeds), row, result in zip(prompts, rows, results, strict=True):
        cache, logits = result.cache, result.last_logits
        for start in range(row.end, prompt.num_tokens, chunk_tokens):
            chunk = PrefillChunk(prompt, embeds, start, min(start + chunk_tokens, prompt.num_tokens), cache)
            [result] = language.prefill_chunks([chunk])
            cache, logits = result.cache, result.last_logits
        states.append(_state(language, prompt, cache, logits))
    return states


def test_prompts_batched_in_one_padded_forward_equal_each_alone_and_generate(
    vision, language, media_files, references
):
    """Three prompts of 133, 39 and 433 tokens share the first step (the longest with its first
    256 tokens), so the shorter two are padded by 123 and 217 positions, then the longest goes
    on in chunks. Each row's KV, linear states and logits equal its prompt prefilled alone, and
    its answer generate()'s; the same step through `prefill_chunks` too."""
    cases = [("mp4", 8), ("png", 1), ("mp4", 32)]
    prompts = [_prompt_and_embeds(vision, language, media_files, m, n) for m, n in cases]
    alone = [language.prefill(prompt, embeds) for prompt, embeds in prompts]
    batched = _batched_then_chunked(language, prompts, chunk_tokens=256)
    for case, got, expected in zip(cases, batched, alone, strict=True):
        _assert_same_prefill(got, expected)
        assert greedy(language, got, language.new_decode_cache(_over_the_wire(got.cache))) == references[case]

    rows = [PrefillChunk(p, e, 0, p.num_tokens) for p, e in prompts]  # whole prompts, one step
    for row, result, expected in zip(rows, language.prefill_chunks(rows), alone, strict=True):
        _assert_same_prefill(_state(language, row.prompt, result.cache, result.last_logits), expected)


def test_without_neutral_padding_the_shorter_rows_states_go_wrong(vision, language, media_files, references):
    """Negative control: the same padded forward with the padding feeding the linear layers'
    states. The logits of each row's last token are still right (causal), but the shorter rows'
    conv and recurrent states ran on through their padding, and their answers change; the
    longest row (no padding) is unaffected."""
    cases = [("mp4", 8), ("png", 1), ("mp4", 32)]
    prompts = [_prompt_and_embeds(vision, language, media_files, m, n) for m, n in cases]
    padded = _batched_then_chunked(language, prompts, chunk_tokens=1000, neutral_padding=False)
    for case, got, (prompt, embeds) in zip(cases[:2], padded[:2], prompts[:2], strict=True):
        expected = language.prefill(prompt, embeds)
        assert torch.allclose(got.last_logits, expected.last_logits, atol=1e-4)
        for i in language.linear_layers:
            assert not torch.allclose(
                got.cache.recurrent_states[i], expected.cache.recurrent_states[i], atol=1e-2
            )
            assert not torch.allclose(got.cache.conv_states[i], expected.cache.conv_states[i], atol=1e-2)
        assert greedy(language, got) != references[case], case
    assert greedy(language, padded[2]) == references[cases[2]]


def test_the_prefill_core_chunks_and_batches_three_requests_at_once(checkpoint, media_files, references):
    """The real prefill stage (scheduler + runner) with `--prefill-chunk-tokens 64` and a step
    budget of 96 tokens: the prompts are cut into chunks interleaved with each other's (a step
    mixes a continuing chunk with first chunks of others). Each answer equals generate()'s."""
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.prefill_svc.config import PrefillConfig, PrefillSchedulerConfig

    scheduler = PrefillSchedulerConfig(max_prefill_tokens_per_step=96, prefill_chunk_tokens=64)
    cases = [("mp4", 32), ("mp4", 8), ("png", 1)]
    with build_embedded_pipeline(
        ModelConfig(model=str(checkpoint)), prefill=PrefillConfig(scheduler=scheduler)
    ) as pipeline:
        summaries = _ask(pipeline, media_files, cases)
        num_steps = pipeline.prefill.load().num_steps
    for case, summary in zip(cases, summaries, strict=True):
        assert summary.token_ids == references[case], case
    assert num_steps >= summaries[0].num_prompt_tokens // 64, "it was not chunked"


def test_epd_ask_with_this_model_answers_as_generate(checkpoint, media_files, references, capsys):
    assert_epd_ask_equals_references(checkpoint, media_files, references, capsys)


@torch.no_grad()
def test_the_padding_hooks_act_on_the_registering_threads_forward_only(language):
    """The colocated server runs a decode step beside a padded prefill on the same layers: the
    prefill's neutral-padding hooks must leave the other thread's projections alone."""
    import threading

    from epd.model_runtime.qwen3_5 import _NeutralPadding

    lm = language._language_model()
    layer = language.linear_layers[0]
    proj = lm.layers[layer].linear_attn.in_proj_a
    x = torch.randn(2, 5, proj.in_features)
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])  # [B, L]
    plain = proj(x)
    other: list[torch.Tensor] = []
    with _NeutralPadding(lm, language.linear_layers, valid, kernel=4):
        worker = threading.Thread(target=lambda: other.append(proj(x)))
        worker.start()
        worker.join(30)
        own = proj(x)
    assert torch.equal(other[0], plain), "another thread's projection went through the padding hook"
    assert (
        torch.isinf(own[1, 3:]).all()
        and torch.equal(own[0], plain[0])
        and torch.equal(own[1, :3], plain[1, :3])
    )
