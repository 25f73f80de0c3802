"""Cache tenancy without models: a request's `cache_salt` is part of the token-cache key, the
per-API-key default salt never shows the key, a request's own salt refines its key's tenant but
cannot name another key's, and bad salts are refused with a message saying what to change. The
caches themselves under two salts: tests/integration/test_tenant_isolation.py."""

from __future__ import annotations

import pytest

from epd.client.request import build_header
from epd.encoder_svc.token_cache import make_cache_key
from epd.gateway.chat_request import parse_chat_request
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MAX_CACHE_SALT_CHARS, check_cache_salt
from epd.stages.errors import InvalidRequest
from epd.transport.auth import api_key_cache_salt, request_cache_salt, tenant_cache_salt
from epd.video.types import SamplingOptions

SHA = "ab" * 32
PARAMS = {"sampling": {"num_frames": 8}, "model": "tiny"}


def test_the_salt_is_part_of_the_token_cache_key():
    plain = make_cache_key(SHA, PARAMS, family="qwen2_vl")
    alice = make_cache_key(SHA, PARAMS, family="qwen2_vl", cache_salt="alice")
    assert alice == make_cache_key(SHA, PARAMS, family="qwen2_vl", cache_salt="alice")
    assert len({plain, alice, make_cache_key(SHA, PARAMS, family="qwen2_vl", cache_salt="bob")}) == 3
    # The shared tenant keeps the keys (and the disk entries) it had before salts existed.
    assert make_cache_key(SHA, PARAMS, family="qwen2_vl", cache_salt="") == plain


def test_an_api_keys_salt_is_stable_per_key_and_never_the_key():
    assert api_key_cache_salt("") == ""  # no key: the shared tenant
    a = api_key_cache_salt("key-of-alice-123")
    assert a == api_key_cache_salt("key-of-alice-123") and a.startswith("key-")
    assert "key-of-alice-123" not in a
    assert a != api_key_cache_salt("key-of-bob-456")
    assert a != api_key_cache_salt("key-of-alice-123", secret="server-secret")
    assert check_cache_salt(a) == a  # it passes the stages' own check


def test_a_request_salt_refines_its_keys_tenant_but_cannot_name_another():
    alice, bob = api_key_cache_salt("alice-key"), api_key_cache_salt("bob-key")
    assert tenant_cache_salt("", "") == ""
    assert tenant_cache_salt("", "user-7") == "user-7"  # no keys: vLLM's per-request salt as given
    assert tenant_cache_salt(alice, "") == alice
    assert tenant_cache_salt(alice, "user-7") == tenant_cache_salt(alice, "user-7")
    assert len({alice, tenant_cache_salt(alice, "user-7"), tenant_cache_salt(alice, "user-8")}) == 3
    assert tenant_cache_salt(alice, "user-7") != tenant_cache_salt(bob, "user-7")
    # Bob naming Alice's salt gets a tenant of his own, not hers.
    assert tenant_cache_salt(bob, alice) not in (alice, tenant_cache_salt(alice, ""))


def test_the_front_doors_salt_follows_the_configured_key():
    # No API key configured: a bearer token means nothing, the request's salt is the tenant.
    assert request_cache_salt(False, "anything", "") == ""
    assert request_cache_salt(False, "anything", "s") == "s"
    # Keys configured: the presented (checked) key is the default tenant, refined by the request's salt.
    assert request_cache_salt(True, "k1", "") == api_key_cache_salt("k1")
    assert request_cache_salt(True, "k1", "s") == tenant_cache_salt(api_key_cache_salt("k1"), "s")
    assert request_cache_salt(True, "k1", "", "sec") == api_key_cache_salt("k1", "sec")
    assert request_cache_salt(True, "k2", "") != request_cache_salt(True, "k1", ""), "one tenant per key"


def test_several_api_keys_each_accepted_and_others_refused(tmp_path):
    from epd.cli import configs
    from epd.cli.parsers.root import build_parser
    from epd.transport.auth import any_key_matches

    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nkey-c\n\n  key-d  \nkey-a\n")
    args = build_parser().parse_args(
        ["serve", "gateway", "--api-key", "key-a", "--api-key", "key-b", "--api-key-file", str(key_file)]
    )
    keys = configs.gateway_config(args).http.api_keys
    assert keys == ("key-a", "key-b", "key-c", "key-d")
    assert all(any_key_matches(k, keys) for k in keys)
    assert not any_key_matches("key-e", keys) and not any_key_matches("", keys)
    assert not any_key_matches("key-a", ())


@pytest.mark.parametrize(
    "salt,message",
    [
        ("x" * (MAX_CACHE_SALT_CHARS + 1), "over the limit of 256"),
        ("user\n7", "printable"),
        ("tab\there", "printable"),
        (7, "must be a string"),
    ],
)
def test_bad_salts_are_refused_with_what_to_change(salt, message):
    with pytest.raises(InvalidRequest, match=message):
        check_cache_salt(salt)


def test_good_salts_pass_unchanged():
    for salt in ("", "user-7", "x" * MAX_CACHE_SALT_CHARS, "ユーザー 7"):
        assert check_cache_salt(salt) == salt


def _chat(**extra):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "https://example.invalid/v.mp4"}},
            {"type": "text", "text": "what?"},
        ]}],
        **extra,
    }  # fmt: skip
    return parse_chat_request(body, "m", SamplingOptions(), GenerationConfig())


def test_the_openai_body_takes_a_cache_salt():
    assert _chat().cache_salt == ""
    assert _chat(cache_salt="user-7").cache_salt == "user-7"
    with pytest.raises(InvalidRequest, match="'cache_salt' must be a string"):
        _chat(cache_salt=7)
    with pytest.raises(InvalidRequest, match="over the limit of 256"):
        _chat(cache_salt="x" * 300)


def test_the_sdk_sends_cache_salt_in_the_header():
    header = build_header("what?", 0, SHA, {"cache_salt": "user-7"})
    assert header.cache_salt == "user-7"
    assert build_header("what?", 0, SHA, {}).cache_salt == ""
