"""KV compression after a prefill drop, with `kv_query_window` longer than the text after the video.

The drop shortens every later layer's sequence; the KV scores' query positions are in that shorter
sequence. Only the text after the video may be queries (`text_query_positions`): a visual token in
the window would be masked with a position shifted as if it followed the dropped tokens (the visual
token at 40 scored as the pre-video text at 16, seeing no visual entry at all).
"""

from __future__ import annotations

import torch

import epd.prefill_svc.pruned_prefill as pruned_prefill_module
from epd.model_runtime.adapter import VisualMeta
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.whole_prefill import prefill_pruned_request
from epd.stages.contracts import EncodedMedia
from epd.stages.messages import question_messages
from epd.token_pruning import PruningConfig, resolve_keep_count
from tests.reference import decode_for_test


def _engine_and_media(tiny_models, media_files) -> tuple[PrefillEngine, EncodedMedia]:
    """The tiny Qwen2-VL's prefill engine and the sample's 8 frames, encoded."""
    adapter = load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "all")
    video = decode_for_test(media_files["mp4"], 8)
    inputs = adapter.preprocess(video)
    embeds = adapter.encode(inputs)
    meta = VisualMeta("video", inputs.grid_thw, inputs.second_per_grid_t, int(embeds.shape[0]))
    media = EncodedMedia(embeds, meta, video.num_frames, [], 0.0, 0.0)
    engine = PrefillEngine(PrefillConfig(), adapter)
    return engine, media


def test_a_window_into_the_video_scores_with_the_text_after_it(tiny_models, media_files, monkeypatch):
    engine, media = _engine_and_media(tiny_models, media_files)

    query_positions: list[torch.Tensor] = []  # [Q] per call: the scores' queries in the dropped sequence
    score = pruned_prefill_module.text_prior_scores

    def spy(queries, caches, positions, visual_index):
        query_positions.append(positions.clone())
        return score(queries, caches, positions, visual_index)

    monkeypatch.setattr(pruned_prefill_module, "text_prior_scores", spy)
    caches = {}
    for window in (0, 60):
        config = PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.5,
                               kv_compress=True, kv_keep_ratio=0.5, kv_query_window=window)  # fmt: skip
        request = engine.render(question_messages("what colour is the moving square?"), media,
                                 GenerationConfig(max_new_tokens=1), config)  # fmt: skip
        caches[window] = prefill_pruned_request(engine.adapter, request).cache

    visual = request.prompt.visual_mask.nonzero().flatten()  # [V] in the prompt
    num_tokens, num_visual = request.prompt.num_tokens, visual.numel()
    num_text_after = num_tokens - int(visual.max()) - 1
    assert num_text_after < 60 < num_tokens  # the window reaches into the video
    num_dropped = num_visual - resolve_keep_count(num_visual, 0.5)
    text_after_in_dropped = torch.arange(num_tokens - num_text_after, num_tokens) - num_dropped
    for positions in query_positions:
        assert positions.tolist() == text_after_in_dropped.tolist()
    for layer in range(len(caches[0].keys)):
        assert torch.equal(caches[60].keys[layer], caches[0].keys[layer])
        assert torch.equal(caches[60].values[layer], caches[0].values[layer])


def test_a_prefill_drop_window_into_the_video_scores_with_the_text_after_it(tiny_models, media_files):
    """The same clamp for the prefill drop's `prefill_query_window`: a window reaching into the
    video made visual tokens queries of the text-guided drop (each scoring the video by what it
    attends to itself, the frames before it), and so kept other tokens than the question would."""
    engine, media = _engine_and_media(tiny_models, media_files)
    kept, caches = {}, {}
    for window in (0, 60):
        config = PruningConfig(prefill_drop=True, prefill_drop_layer=1, prefill_keep_ratio=0.5,
                               prefill_query_window=window)  # fmt: skip
        request = engine.render(question_messages("what colour is the moving square?"), media,
                                 GenerationConfig(max_new_tokens=1), config)  # fmt: skip
        out = prefill_pruned_request(engine.adapter, request)
        kept[window], caches[window] = out.handle.kept_visual_token_index, out.cache

    visual = request.prompt.visual_mask.nonzero().flatten()
    assert request.prompt.num_tokens - int(visual.max()) - 1 < 60  # the window reaches into the video
    assert kept[60] == kept[0]
    for layer in range(len(caches[0].keys)):
        assert torch.equal(caches[60].keys[layer], caches[0].keys[layer])
