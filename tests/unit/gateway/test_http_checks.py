"""The checks a request passes before its handler runs (`epd.gateway.http_checks.refusal`), alone:
each refusal's status and error type, in the docstring's order, and None for a request that may
run. Requests built with aiohttp's own `make_mocked_request`, no server."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import make_mocked_request

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_checks import authorized, refusal
from epd.stages.server_config import ServerConfig

CHAT = "/v1/chat/completions"
KEYED = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0, api_keys=("sk-1",)))
OPEN = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0))
GOOD = {"Host": "localhost:8000", "Content-Type": "application/json", "Authorization": "Bearer sk-1"}


def _refusal(config: GatewayConfig, method: str = "POST", path: str = CHAT, route: str = CHAT, **headers):
    request = make_mocked_request(method, path, headers={**GOOD, **headers})
    response = refusal(request, route, config)
    if response is None:
        return None
    return response.status, json.loads(response.body)["error"]["type"], dict(response.headers)


def test_a_request_that_passes_every_check_may_run():
    assert _refusal(KEYED) is None
    assert _refusal(OPEN, Authorization="") is None


@pytest.mark.parametrize(
    ("config", "headers", "status", "error_type"),
    [
        (KEYED, {"Expect": "nothing-else"}, 417, "invalid_request_error"),
        (OPEN, {"Host": "attacker.example"}, 403, "permission_error"),
        (KEYED, {"Sec-Fetch-Site": "cross-site"}, 403, "permission_error"),
        (KEYED, {"Authorization": "Bearer wrong"}, 401, "authentication_error"),
        (KEYED, {"Content-Encoding": "br"}, 415, "invalid_request_error"),
        (KEYED, {"Content-Type": "text/plain"}, 415, "invalid_request_error"),
    ],
)
def test_each_check_refuses_with_its_status(config, headers, status, error_type):
    assert _refusal(config, **headers)[:2] == (status, error_type)


def test_the_checks_run_in_order_the_first_that_fails_answers():
    """A wrong key with a bad Expect is the Expect's 417; a wrong key with a text body the key's 401."""
    assert _refusal(KEYED, Expect="nothing-else", Authorization="Bearer wrong")[0] == 417
    assert _refusal(KEYED, **{"Content-Type": "text/plain", "Authorization": "Bearer wrong"})[0] == 401


def test_a_content_coding_refusal_names_the_codings_taken():
    _, _, headers = _refusal(KEYED, **{"Content-Encoding": "br"})
    assert "gzip" in headers["Accept-Encoding"]


def test_the_key_guards_vllms_paths_even_unrouted_and_leaves_health_open():
    assert _refusal(KEYED, "GET", "/v1/embeddings", "unmatched", Authorization="")[0] == 401
    assert _refusal(KEYED, "GET", "/health", "/health", Authorization="") is None
    # a GET of a body route reads no body: no content-type check
    assert _refusal(KEYED, "GET", CHAT, CHAT, **{"Content-Type": "text/plain"}) is None


def test_authorized_takes_any_configured_key_and_nothing_else():
    two = GatewayConfig(server=ServerConfig(port=0), http=HttpApiConfig(port=0, api_keys=("a", "b")))
    assert authorized(make_mocked_request("GET", "/", headers={"Authorization": "Bearer b"}), two)
    assert not authorized(make_mocked_request("GET", "/", headers={"Authorization": "Bearer c"}), two)
    assert not authorized(make_mocked_request("GET", "/"), two)
