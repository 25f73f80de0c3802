"""Qwen3.5 (hybrid Gated DeltaNet + full attention) through three real service processes and the
gateway (`epd serve encoder|prefill|decode|gateway`), asked over gRPC with `EpdClient`: the answer
equals `model.generate(do_sample=False)` token for token for 8 and 32 frames and an image, on the
tiny checkpoint of the real transformers classes that the adapter test uses. The reported KV size
counts the linear layers' conv and recurrent states that cross Prefill -> Decode beside the
attention KV; two requests at once (sharing the decode batch, linear states included) each equal
their own reference; a pruning knob is refused with INVALID_ARGUMENT naming the family. The
prefill service runs with `--prefill-chunk-tokens 64`: the 8- and 32-frame prompts (133 and 433
tokens) are prefilled in chunks that carry the linear states from one to the next. In one process
with frame groups never merged, a clip over the video processor's t x h x w bound and odd frame
counts (a 1-frame last group) give generate()'s prompt and answer: groups are sized and padded as
the whole clip."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from epd.client import EpdClient, EpdError
from epd.encoder_svc.config import EncoderConfig
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.hf_reference import whole_model
from epd.model_runtime.qwen3_5 import Qwen3_5Adapter
from tests.families import (
    CASES,
    QUESTION,
    assert_pipeline_answers_as_generate,
    assert_reference_varies,
    build_qwen3_5_checkpoint,
    generate_references,
    make_clip_over_qwen3_size_limit,
    qwen_processor_inputs,
)
from tests.stack import Stack

MAX_NEW_TOKENS = 12  # short answers: every token still has to match, and CI time matters
CHUNK_TOKENS = 64  # the video prompts run in several chunks, with boundaries inside the video tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen3_5_checkpoint(tmp_path_factory.mktemp("qwen3_5_stack") / "m")


@pytest.fixture(scope="module")
def stack(checkpoint, tmp_path_factory):
    extra = {"prefill": ["--prefill-chunk-tokens", str(CHUNK_TOKENS)]}
    with Stack(checkpoint, tmp_path_factory.mktemp("logs_q35"), extra=extra) as s:
        yield s


@pytest.fixture(scope="module")
def whole(checkpoint):
    return whole_model(checkpoint)


@pytest.fixture(scope="module")
def references(whole, media_files):
    return generate_references(whole, media_files, qwen_processor_inputs, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def language(checkpoint):
    """The language part as prefill and decode load it: its KV and linear-state sizes."""
    return Qwen3_5Adapter(str(checkpoint), ModelConfig(), {"language"})


def _ask(stack, media_files, media: str, num_frames: int, **options):
    with EpdClient(stack.gateway) as client:
        return client.ask(
            media_files[media], QUESTION, num_frames=num_frames, max_new_tokens=MAX_NEW_TOKENS, **options
        )


def _expected_kv_bytes(language, num_prompt_tokens: int) -> int:
    """Attention KV per token times the prompt, plus the linear layers' fixed-size states."""
    return language.kv_bytes_per_token * num_prompt_tokens + language.linear_state_bytes


@pytest.mark.parametrize("media,num_frames", CASES)
def test_three_services_equal_generate_and_count_the_linear_states(
    stack, media_files, references, language, media, num_frames
):
    ref = references[(media, num_frames)]
    assert_reference_varies(ref, MAX_NEW_TOKENS)
    result = _ask(stack, media_files, media, num_frames)
    assert result.token_ids == ref
    assert result.num_frames == (1 if media == "png" else num_frames)
    assert language.linear_state_bytes > 0
    assert result.kv_num_bytes == _expected_kv_bytes(language, result.num_prompt_tokens)


def test_two_requests_at_once_each_equal_their_reference(stack, media_files, references, language):
    """Both requests are in flight together; where their decoding overlaps, decode runs them in
    one batch whose rows carry each request's own linear states (mixing them up, or losing a row's
    states when the other leaves, would change the answers)."""
    cases = [("mp4", 8), ("png", 1)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _ask(stack, media_files, *case), cases))
    for case, result in zip(cases, results, strict=True):
        assert result.token_ids == references[case], case
        assert result.kv_num_bytes == _expected_kv_bytes(language, result.num_prompt_tokens)
    assert stack.alive()


def test_a_pruning_knob_is_invalid_argument_naming_the_family(stack, media_files):
    with pytest.raises(EpdError) as err:
        _ask(stack, media_files, "mp4", 8, pruning_knobs={"prefill_drop": True, "prefill_keep_ratio": 0.5})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not supported for model family qwen3_5" in err.value.message
    assert stack.alive()


def test_in_one_process_with_steps_side_by_side_each_request_equals_its_reference(
    checkpoint, media_files, references
):
    """The colocated pipeline: a padded prefill of two prompts (its hooks neutralise the padding
    for the linear layers) runs beside decode steps of the others on a second model thread; the
    hooks must act on the prefill's own forward only."""
    import asyncio

    from tests.embedded import ask_tokens

    cases = [("png", 1, 0.0), ("mp4", 8, 0.0), ("mp4", 32, 0.0), ("png", 1, 0.2), ("mp4", 8, 0.2)]
    with build_embedded_pipeline(ModelConfig(model=str(checkpoint))) as pipeline:

        async def run():
            return await asyncio.gather(
                *(
                    ask_tokens(pipeline, media_files[m], QUESTION, f, MAX_NEW_TOKENS, delay_s)
                    for m, f, delay_s in cases
                )
            )

        got = asyncio.run(run())
    for (media, num_frames, _), tokens in zip(cases, got, strict=True):
        assert tokens == references[(media, num_frames)], (media, num_frames)


@pytest.fixture(scope="module")
def big_clip(tmp_path_factory):
    return make_clip_over_qwen3_size_limit(tmp_path_factory.mktemp("big_clip"))


@pytest.fixture(scope="module")
def unmerged_pipeline(checkpoint):
    """Every frame group 2 frames, an odd count's last one 1: what a request gets under load."""
    model = ModelConfig(model=str(checkpoint))
    with build_embedded_pipeline(
        model, encoder=EncoderConfig(model=model, merge_decoded_groups=False)
    ) as pipeline:
        yield pipeline


@pytest.mark.parametrize("num_frames", [32, 5, 31])
def test_unmerged_frame_groups_are_sized_and_padded_as_the_whole_clip(
    unmerged_pipeline, whole, big_clip, num_frames
):
    """Qwen3-VL's processor, so its rules: 31-32 frames of the 224x192 clip are over
    size.longest_edge and shrink (2-frame groups alone would not), and 5 and 31 frames end in a
    1-frame group that is padded as the whole clip's last temporal patch."""
    assert_pipeline_answers_as_generate(unmerged_pipeline, whole, big_clip, num_frames, MAX_NEW_TOKENS)
