"""`pruning.transfer_bytes` through the real stack (four processes): the tensor bytes that crossed a
process boundary, the visual embeddings encoder -> gateway -> prefill (twice), the KV cache
prefill -> decode, and with decode eviction the visual-entry mask prefill -> gateway -> decode
(twice); the same number at every front door (gRPC summary, SDK, HTTP with and without streaming);
smaller with token dropping; 0 from the embedded pipeline (what `epd serve --colocate` and
`epd ask` without `--endpoint` run), where nothing crosses."""

from __future__ import annotations

import asyncio
import base64
import json

import openai
import pytest

from epd.client import EpdClient
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions

QUESTION = "what colour is the square?"
NUM_FRAMES = 4
MAX_NEW_TOKENS = 6
FLOAT32_BYTES = 4  # the stack's dtype (--dtype's default): embeddings and KV cache
DROPPING = {"spatial_merge": True, "spatial_merge_threshold": -1.0, "prefill_drop": True,
            "prefill_drop_layer": 1, "prefill_keep_ratio": 0.25}  # fmt: skip


@pytest.fixture(scope="module")
def sizes(tiny_models) -> dict[str, int]:
    text = json.loads((tiny_models["qwen2_vl"] / "config.json").read_text())
    text = text.get("text_config", text)
    return {
        "hidden_size": text["hidden_size"],
        "head_dim": text["hidden_size"] // text["num_attention_heads"],
    }


@pytest.fixture(scope="module")
def client(shared_stack):
    with EpdClient(shared_stack.gateway, timeout_s=120) as c:
        yield c


def _ask(client, media_files, **pruning):
    knobs = {name: str(value) for name, value in pruning.items()}
    return client.ask(media_files["mp4"], QUESTION, num_frames=NUM_FRAMES, max_new_tokens=MAX_NEW_TOKENS,
                      pruning_knobs=knobs)  # fmt: skip


def _embeddings_bytes(num_visual_tokens: int, sizes: dict[str, int]) -> int:
    return num_visual_tokens * sizes["hidden_size"] * FLOAT32_BYTES


def test_the_stack_counts_embeddings_on_both_hops_and_the_kv_pulled(client, media_files, sizes):
    result = _ask(client, media_files)
    assert result.pruning.stages == () and result.kv_num_bytes > 0
    embeddings = _embeddings_bytes(result.num_visual_tokens, sizes)
    assert result.pruning.transfer_bytes == 2 * embeddings + result.kv_num_bytes


def test_token_dropping_cuts_the_bytes_moved_and_the_report_says_by_how_much(client, media_files, sizes):
    full = _ask(client, media_files)
    dropped = _ask(client, media_files, **DROPPING)
    assert dropped.num_visual_tokens < full.num_visual_tokens, "the encoder merged tokens"
    assert dropped.kv_num_bytes < full.kv_num_bytes, "prefill dropped tokens"
    embeddings = _embeddings_bytes(dropped.num_visual_tokens, sizes)
    assert dropped.pruning.transfer_bytes == 2 * embeddings + dropped.kv_num_bytes
    assert dropped.pruning.transfer_bytes < full.pruning.transfer_bytes


def test_decode_eviction_adds_its_visual_entry_mask_on_both_of_its_hops(client, media_files, sizes):
    result = _ask(client, media_files, decode_evict=True)
    assert "decode_evict" in {s.stage for s in result.pruning.stages}
    # One byte per (layer, KV head, cached entry); the cache holds K and V of head_dim floats for each.
    mask = result.kv_num_bytes // (2 * sizes["head_dim"] * FLOAT32_BYTES)
    embeddings = _embeddings_bytes(result.num_visual_tokens, sizes)
    assert result.pruning.transfer_bytes == 2 * embeddings + result.kv_num_bytes + 2 * mask


def test_every_front_door_reports_the_same_number(shared_stack, client, media_files, sizes):
    http = openai.OpenAI(
        base_url=f"http://127.0.0.1:{shared_stack.http_port}/v1", api_key="unused", max_retries=0
    )
    url = "data:video/mp4;base64," + base64.b64encode(media_files["mp4"].read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]  # fmt: skip
    extra = {"media": {"num_frames": NUM_FRAMES}, "pruning": {"knobs": DROPPING}}
    completion = http.chat.completions.create(model="epd", messages=messages, max_tokens=MAX_NEW_TOKENS,
                                              extra_body=extra)  # fmt: skip
    chunks = list(http.chat.completions.create(model="epd", messages=messages, max_tokens=MAX_NEW_TOKENS,
                                               extra_body=extra, stream=True))  # fmt: skip
    streamed = [c.model_extra["epd"] for c in chunks if (c.model_extra or {}).get("epd")]
    sdk = _ask(client, media_files, **DROPPING)
    expected = 2 * _embeddings_bytes(sdk.num_visual_tokens, sizes) + sdk.kv_num_bytes
    assert sdk.pruning.transfer_bytes == sdk.to_dict()["pruning"]["transfer_bytes"] == expected
    assert completion.epd["pruning"]["transfer_bytes"] == expected
    assert len(streamed) == 1 and streamed[0]["pruning"]["transfer_bytes"] == expected


def test_the_embedded_pipeline_moves_nothing_between_processes(tiny_models, media_files):
    request = AskRequest(
        question_messages(QUESTION),
        MediaInput(media_files["mp4"].read_bytes()),
        SamplingOptions(num_frames=NUM_FRAMES),
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS),
    )

    async def ask(pipeline) -> AskSummary:
        async for item in pipeline.ask(request):
            if isinstance(item, AskSummary):
                return item
        raise AssertionError("no summary")

    with build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"]))) as pipeline:
        summary = asyncio.run(ask(pipeline))
    assert summary.kv_num_bytes > 0, "the decoder took a cache, from the in-process store"
    assert summary.pruning.transfer_bytes == 0
