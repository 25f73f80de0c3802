"""The pruning interface of `VLMAdapter` (adapter.py, "pruning interface") on tiny checkpoints of
the real transformers classes: the captured queries are the ones each family's attention uses
(Qwen3-VL's per-head q/k norm included), the layer-by-layer pass without a drop is the adapter's
own prefill, a drop before layer 0 runs every layer on the survivors, the decode cache is read
and shrunk through the adapter, and Qwen3-VL refuses the layer-by-layer prefill by name."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.adapter import Prompt, UnsupportedByFamily
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.kv_cache import KvCache
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter
from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from epd.token_pruning.layerwise_prefill import prefill_with_drop

ADAPTERS = {"qwen2_vl": Qwen2VLAdapter, "qwen3_vl": Qwen3VLAdapter}
LENGTH, VISUAL = 24, torch.arange(4, 16)  # a stand-in prompt: 12 "visual" rows among text


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def language(request, tmp_path_factory):
    path = build_checkpoint(tmp_path_factory.mktemp(request.param) / "m", TinyVLMSpec(family=request.param))
    return ADAPTERS[request.param](str(path), ModelConfig(), {"language"})


def _prompt(adapter) -> tuple[Prompt, torch.Tensor]:
    """Text ids with random rows in place of visual embeddings; plain positions on every row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (1, LENGTH), generator=g)
    mask = torch.zeros(LENGTH, dtype=torch.bool)
    mask[VISUAL] = True
    positions = torch.arange(LENGTH).view(1, 1, -1).expand(4, 1, -1).clone()
    return Prompt(ids, positions, mask), torch.randn(VISUAL.numel(), adapter.hidden_size, generator=g)


def _embeds(adapter, prompt: Prompt, visual: torch.Tensor) -> torch.Tensor:
    hidden = adapter.embed(prompt.input_ids)
    hidden[0, VISUAL] = visual.to(hidden.dtype)
    return hidden


@torch.no_grad()
def test_captured_queries_are_the_ones_the_attention_scores_with(language):
    """softmax(q k^T / sqrt(D)) over the model's own cached (rotated) keys equals the attention
    weights the model reports, at every layer, for the captured rows."""
    from transformers import DynamicCache

    prompt, visual = _prompt(language)
    lm = language._language_model()  # the test, not the stages, runs the model with weights out
    qpos = torch.tensor([LENGTH - 3, LENGTH - 1])
    lm.config._attn_implementation = "eager"
    cache = DynamicCache(config=lm.config)
    with language.capture_queries(range(language.num_layers), qpos) as cap:
        out = lm(
            inputs_embeds=_embeds(language, prompt, visual),
            position_ids=prompt.position_ids,
            past_key_values=cache,
            use_cache=True,
            output_attentions=True,
        )
    dims = language.text_dims
    assert sorted(cap.queries) == list(range(dims.num_layers)) and dims.head_dim > 0
    for layer, (keys, _) in enumerate(language.decode_cache_kv(cache)):
        q = cap.queries[layer]  # [1, heads, Q, D]
        assert q.shape == (1, dims.num_heads, 2, dims.head_dim)
        k = keys.repeat_interleave(dims.num_heads // dims.num_kv_heads, dim=1)  # [1, heads, L, D]
        scores = (q @ k.transpose(-1, -2)) * dims.head_dim**-0.5
        causal = torch.arange(LENGTH)[None] > qpos[:, None]  # [Q, L]
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1)[0]
        torch.testing.assert_close(weights, out.attentions[layer][0][:, qpos], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_a_capture_records_its_own_threads_forward_and_not_a_concurrent_one(language):
    """The colocated server runs a decode step beside a prefill step on the same layers: the
    prefill drop's query capture must not record (or break on) the other thread's forward."""
    import threading

    prompt, visual = _prompt(language)
    lm = language._language_model()
    run = lambda: lm(inputs_embeds=_embeds(language, prompt, visual), position_ids=prompt.position_ids)  # noqa: E731
    with language.capture_queries(range(language.num_layers), torch.tensor([LENGTH - 1])) as cap:
        other = threading.Thread(target=run)
        other.start()
        other.join(60)
        assert cap.queries == {}, "a forward in another thread went through the capture"
        run()
    assert sorted(cap.queries) == list(range(language.num_layers))


@torch.no_grad()
def test_layerwise_pass_without_a_drop_is_the_adapters_prefill(language):
    prompt, visual = _prompt(language)
    if isinstance(language, Qwen3VLAdapter):
        with pytest.raises(UnsupportedByFamily, match=r"Qwen3-VL \(qwen3_vl\).*prefill drop"):
            language.layerwise_prefill(_embeds(language, prompt, visual), prompt.position_ids)
        with pytest.raises(ValueError, match="DeepStack"):  # a ValueError: the stages answer INVALID_ARGUMENT
            prefill_with_drop(language, _embeds(language, prompt, visual), prompt.position_ids, VISUAL, 0)
        return
    state = language.prefill(prompt, visual)
    out = prefill_with_drop(language, _embeds(language, prompt, visual), prompt.position_ids, VISUAL, None)
    torch.testing.assert_close(language.logits(out.last_hidden_state[:, -1:])[0, -1], state.last_logits)
    kv = language.chunk_cache_to_kv(out.past_key_values)
    for mine, theirs in zip(kv.keys + kv.values, state.cache.keys + state.cache.values, strict=True):
        torch.testing.assert_close(mine, theirs)


@torch.no_grad()
def test_a_drop_before_layer_0_runs_every_layer_on_the_survivors(language):
    if isinstance(language, Qwen3VLAdapter):
        pytest.skip("Qwen3-VL refuses the layer-by-layer prefill (test above)")
    prompt, visual = _prompt(language)
    out = prefill_with_drop(
        language, _embeds(language, prompt, visual), prompt.position_ids, VISUAL, 0, keep_ratio=0.5
    )
    assert out.visual_per_stage == [6]
    assert out.tokens_per_layer == [LENGTH - 6] * language.num_layers
    kv = language.chunk_cache_to_kv(out.past_key_values)
    assert all(k.shape[2] == LENGTH - 6 for k in kv.keys)


@torch.no_grad()
def test_the_decode_cache_is_read_and_shrunk_through_the_adapter(language):
    dims = language.text_dims
    g = torch.Generator().manual_seed(3)
    shape = (1, dims.num_kv_heads, 10, dims.head_dim)
    kv = KvCache(
        [torch.randn(shape, generator=g) for _ in range(dims.num_layers)],
        [torch.randn(shape, generator=g) for _ in range(dims.num_layers)],
    )
    cache = language.new_decode_cache(kv)
    layers = language.decode_cache_kv(cache)
    assert len(layers) == dims.num_layers and torch.equal(layers[0][0], kv.keys[0])
    for i, (keys, values) in enumerate(layers):
        language.set_decode_cache_kv(cache, i, keys[:, :, 2:], values[:, :, 2:])
    assert all(k.shape[2] == 8 for k, _ in language.decode_cache_kv(cache))
    logits = language.decode_step(5, torch.full((4,), 10), cache)
    assert logits.shape == (language.logits(torch.zeros(1, dims.hidden_size)).shape[-1],)
    assert all(k.shape[2] == 9 for k, _ in language.decode_cache_kv(cache))
