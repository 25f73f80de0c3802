"""Tenant isolation of the caches (`cache_salt`), tiny Qwen2-VL: through the real encoder engine
(another salt encodes again and its by-hash request gets exactly the unknown-media NOT_FOUND),
prefill's prefix cache in one process (another salt reuses no KV), and a real stack behind an API
key over the HTTP and gRPC APIs (per-request salts under the key's tenant). The key derivation
alone: tests/unit/stages/test_cache_salt.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re

import grpc
import openai
import pytest

from epd.client import VIDEO, EpdClient, EpdError, Message
from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.token_cache import TokenCacheConfig
from epd.gateway.ask_types import AskRequest, AskSummary
from epd.gateway.embedded import build_embedded_pipeline
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.errors import NotFound
from epd.stages.messages import from_chat_template
from epd.video.types import SamplingOptions
from tests.stack import Stack

NUM_FRAMES = 4
QUESTION = "what colour is the moving square?"
API_KEY = "tenant-test-key"
OTHER_KEY = "tenant-isolation-other-key"


# -- the encoder's token cache ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter(tiny_models):
    return load_adapter(ModelConfig(model=str(tiny_models["qwen2_vl"])), "encoder")


def _encode(engine: EncoderEngine, data: bytes | None, salt: str, sha: str = ""):
    return engine.encode(MediaInput(data, sha), SamplingOptions(num_frames=NUM_FRAMES), lambda e: None,
                         cache_salt=salt)  # fmt: skip


def test_another_salt_encodes_again_and_the_same_salt_hits(adapter, media_files, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    alice = _encode(engine, data, "alice")
    bob = _encode(engine, data, "bob")
    assert not alice.cache_hit and not bob.cache_hit  # two encodes, no hit across the salts
    assert _encode(engine, data, "alice").cache_hit and _encode(engine, data, "bob").cache_hit
    assert not _encode(engine, data, "").cache_hit  # the shared tenant is a tenant of its own
    stats = engine.cache.stats()
    assert (stats.num_hits, stats.num_misses, stats.num_entries) == (2, 3, 3)


def test_another_salt_builds_the_keyframe_index_again(adapter, media_files, closing):
    """A keyframe-index hit skips the demux pass, which the decode time a client is told shows:
    the same bytes from another tenant build their index again; from the same tenant, once."""
    # no token cache
    engine = closing(EncoderEngine(EncoderConfig(cache=TokenCacheConfig(memory_budget_bytes=0)), adapter))
    data = media_files["mp4"].read_bytes()
    index_cache = engine.decoder.index_cache
    _encode(engine, data, "alice")
    _encode(engine, data, "bob")
    assert (index_cache.num_misses, index_cache.num_hits) == (2, 0)
    _encode(engine, data, "alice")
    _encode(engine, data, "bob")
    assert (index_cache.num_misses, index_cache.num_hits) == (2, 2)


def test_a_by_hash_request_of_another_tenant_is_not_found_like_unknown_media(adapter, media_files, closing):
    engine = closing(EncoderEngine(EncoderConfig(), adapter))
    data = media_files["mp4"].read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    _encode(engine, data, "alice")
    assert _encode(engine, None, "alice", sha).cache_hit
    with pytest.raises(NotFound) as other_tenant:
        _encode(engine, None, "bob", sha)
    with pytest.raises(NotFound) as unknown:  # an encoder that never saw the media
        _encode(closing(EncoderEngine(EncoderConfig(), adapter)), None, "alice", sha)
    assert str(other_tenant.value) == str(unknown.value)
    assert "send the file itself" in str(other_tenant.value)


# -- prefill's prefix cache ------------------------------------------------------------------------


def _ask(pipeline, video: bytes, history: list[dict], salt: str) -> AskSummary:
    request = AskRequest(
        messages=from_chat_template(history),
        media=MediaInput(video),
        sampling=SamplingOptions(num_frames=NUM_FRAMES),
        generation=GenerationConfig(max_new_tokens=4),
        cache_salt=salt,
    )

    async def run():
        return [item async for item in pipeline.ask(request)]

    return next(i for i in asyncio.run(run()) if isinstance(i, AskSummary))


def test_another_salt_reuses_no_prefix_kv(tiny_models, media_files):
    pipeline = build_embedded_pipeline(ModelConfig(model=str(tiny_models["qwen2_vl"])))
    try:
        video = media_files["mp4"].read_bytes()
        first = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
        turn1 = _ask(pipeline, video, first, "alice")
        follow_up = [*first, {"role": "assistant", "content": turn1.answer},
                     {"role": "user", "content": [{"type": "text", "text": "which way does it move?"}]}]  # fmt: skip
        bob = _ask(pipeline, video, follow_up, "bob")
        assert bob.num_reused_prompt_tokens == 0 and not bob.encoder_cache_hit
        alice = _ask(pipeline, video, follow_up, "alice")
        assert alice.num_reused_prompt_tokens >= turn1.num_prompt_tokens and alice.encoder_cache_hit
        assert alice.token_ids == bob.token_ids  # isolation changes what is shared, never the answer
    finally:
        pipeline.close()


# -- a real stack behind an API key ----------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"gateway": ["--api-key", API_KEY, "--api-key", OTHER_KEY]}
    with Stack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_tenants"), extra=extra, http=True) as s:
        yield s


def _chat(stack, video: bytes, salt: str | None, question: str = QUESTION, key: str = API_KEY) -> dict:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=key, max_retries=0)
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    body = {"media": {"num_frames": NUM_FRAMES}, **({"cache_salt": salt} if salt is not None else {})}
    completion = client.chat.completions.create(
        model="epd",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],  # fmt: skip
        max_tokens=4,
        extra_body=body,
    )
    return completion.epd  # type: ignore[attr-defined]


def _without_request_id(message: str) -> str:
    return re.sub(r"request id [0-9a-f]+", "request id ?", message)


def test_tenants_share_nothing_across_and_everything_within(stack, media_files):
    video = media_files["mp4_b"].read_bytes()
    sha = hashlib.sha256(video).hexdigest()
    assert not _chat(stack, video, "tenant-a")["encoder_cache_hit"]
    assert not _chat(stack, video, "tenant-b")["encoder_cache_hit"]  # no hit across tenants
    again = _chat(stack, video, "tenant-a", "and which way does it move?")
    assert again["encoder_cache_hit"] and again["num_reused_prompt_tokens"] > again["num_visual_tokens"]
    # The API key's own tenant (no salt) saw nothing yet; then HTTP and gRPC share it.
    assert not _chat(stack, video, None)["encoder_cache_hit"]
    with EpdClient(stack.gateway, timeout_s=120, api_key=API_KEY) as client:
        messages = [Message.user(VIDEO, QUESTION)]
        options = {"num_frames": NUM_FRAMES, "max_new_tokens": 4}
        by_hash = client.ask(None, messages=messages, media_sha256=sha, **options)
        assert by_hash.encoder_cache_hit and by_hash.media_num_bytes_sent == 0
        assert client.ask(
            None, messages=messages, media_sha256=sha, cache_salt="tenant-a", **options
        ).encoder_cache_hit
        with pytest.raises(EpdError) as other:  # a tenant that never sent the bytes
            client.ask(None, messages=messages, media_sha256=sha, cache_salt="tenant-c", **options)
        with pytest.raises(EpdError) as unknown:  # media nobody sent
            client.ask(None, messages=messages, media_sha256="0" * 64, cache_salt="tenant-a", **options)
        assert other.value.code == unknown.value.code == grpc.StatusCode.NOT_FOUND
        assert "send the file itself" in other.value.message
        # The same words but for the hash named and the request id.
        assert _without_request_id(other.value.message).replace(sha[:12], "0" * 12) == _without_request_id(
            unknown.value.message
        )
        with pytest.raises(EpdError, match="over the limit of 256") as bad:
            client.ask(None, messages=messages, media_sha256=sha, cache_salt="x" * 300, **options)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_each_api_key_is_its_own_tenant(stack, media_files):
    """Two keys of one gateway: a video one key's caller sent is no hit for the other's, by bytes
    or by hash, while each key's own repeat hits; a key the gateway does not hold is refused."""
    video = media_files["mp4"].read_bytes()
    sha = hashlib.sha256(video).hexdigest()
    assert not _chat(stack, video, None, key=API_KEY)["encoder_cache_hit"]
    assert not _chat(stack, video, None, key=OTHER_KEY)["encoder_cache_hit"], "no hit across keys"
    assert _chat(stack, video, None, "and which way does it move?", key=OTHER_KEY)["encoder_cache_hit"]
    messages = [Message.user(VIDEO, QUESTION)]
    options = {"num_frames": NUM_FRAMES, "max_new_tokens": 4}
    with EpdClient(stack.gateway, timeout_s=120, api_key=OTHER_KEY) as client:
        assert client.ask(None, messages=messages, media_sha256=sha, **options).encoder_cache_hit
    with pytest.raises(openai.AuthenticationError):
        _chat(stack, video, None, key="not-a-key-of-this-gateway")
