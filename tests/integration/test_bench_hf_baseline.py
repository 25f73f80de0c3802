"""`epd bench serve`'s hf baseline (processor + generate() on the unsplit model) prompts the model as
the exactness tests' reference does, for each family (`epd.model_runtime.hf_reference`, which both
use): it gave every family Qwen2-VL's video arguments, which LLaVA-OneVision's processor refuses
and from which Qwen3-VL's timestamps come out wrong."""

from __future__ import annotations

import pytest
from tqdm import tqdm

from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
from tests.reference import decode_for_test, reference_tokens

QUESTION = "what moves?"
NUM_FRAMES = 4
MAX_NEW_TOKENS = 6


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision", "glm4v", "internvl"])
def test_the_hf_baseline_generates_the_references_tokens(tiny_models, media_files, tmp_path, family):
    from epd.bench.serve import build_parser
    from epd.bench.serve_baselines import run_hf_baseline

    model = tiny_models.get(family) or build_checkpoint(tmp_path / family, TinyVLMSpec(family=family))
    clip = media_files["mp4"]
    args = build_parser().parse_args(  # --endpoint: the parser's; the baseline calls no server
        [
            "--endpoint",
            "127.0.0.1:1",
            "--model",
            str(model),
            "--num-frames",
            str(NUM_FRAMES),
            "--max-new-tokens",
            str(MAX_NEW_TOKENS),
        ]
    )
    with tqdm(total=1, disable=True) as progress:
        [result], _ = run_hf_baseline(args, [(clip.read_bytes(), QUESTION)], progress)
    want = reference_tokens(model, decode_for_test(clip, NUM_FRAMES), QUESTION, MAX_NEW_TOKENS)
    assert result.ok and result.num_output_tokens == len(want) > 0, (result, want)
