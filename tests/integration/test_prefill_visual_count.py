"""Every family's `prefill` refuses visual embeddings that do not fill the prompt's visual
positions one for one (`HfTextAdapter._prefill_whole`, one check for all). The prefill engine
checks the count against the grid first (`request_checks.check_visual`); this is the adapter's
own guard for any other caller: `masked_scatter` would silently take the first of too many.
Real tiny checkpoints of every family."""

from __future__ import annotations

import pytest
import torch

from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import question_message
from epd.model_runtime.loader import load_adapter
from tests.families import FAMILIES, family_checkpoints, load_video, visual_meta


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return family_checkpoints(tiny_models, tmp_path_factory.mktemp("visual_count_models"))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_refuses_visual_embeddings_that_do_not_fill_the_placeholders(
    checkpoints, media_files, family
):
    adapter = load_adapter(ModelConfig(model=str(checkpoints[family])), "all")
    video = load_video(media_files, "mp4", 4)
    meta = visual_meta(adapter, adapter.preprocess(video))
    prompt = adapter.build_prompt(question_message(video, "what moves?"), meta)
    n = int(prompt.visual_mask.sum())
    assert n > 0
    for count in (n + 1, n - 1):
        embeds = torch.zeros(count, adapter.hidden_size)
        with pytest.raises(ValueError, match=f"^{count} visual embeddings for {n} visual positions$"):
            adapter.prefill(prompt, embeds)
