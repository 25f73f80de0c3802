"""The checks every HTTP request passes before its handler runs (the HTTP API's middleware,
`HttpApi._answer`, asks `refusal`): the Expect header, the host name, a cross-site browser's POST,
the API key, the content coding and a body route's content type, each refused with its own status
and an OpenAI-style error saying what to send instead."""

from __future__ import annotations

from aiohttp import web

from epd.gateway.browser_guard import cross_site_browser_request, rebound_host
from epd.gateway.config import GatewayConfig
from epd.gateway.http_body import (
    SUPPORTED_ENCODINGS,
    not_json_content_type,
    not_json_content_type_message,
    unsupported_encoding,
    unsupported_encoding_message,
    unsupported_expect,
)
from epd.gateway.http_error_responses import json_error
from epd.gateway.web.routes import BODY_ROUTES
from epd.transport.auth import any_key_matches, bearer_token

KEYED_PATH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/invocations", "/tokenize", "/detokenize")
"""With --api-key, a path starting with one of these needs the key whether or not a route takes it
(plain prefixes, as vLLM's AuthenticationMiddleware matches them): vLLM guards /v1, /v2, /inference
and /cohere always and the prefix of every route it registers (/invocations, /tokenize), so a
client without the key gets vLLM's 401 before a 404 for a vLLM path epd does not serve
(/v1/embeddings, /invocations), and a path no vLLM serving a generative model has (/pooling,
/classify, /sleep) a 404 there and here. Besides these, the POSTs of `BODY_ROUTES` (the web demo's)."""


def refusal(request: web.Request, route: str, config: GatewayConfig) -> web.Response | None:
    """The error a request gets before its handler runs (None: it may run), in this order: an
    Expect other than 100-continue, a rebound host name, a cross-site browser's POST, a missing
    or wrong API key, a content coding or (a body route's) content type not taken."""
    if unsupported_expect(request):
        return json_error(
            417, "the only Expect this server supports is 100-continue", "invalid_request_error"
        )
    if rebound_host(request, config):
        return json_error(
            403,
            "this gateway has no API key and serves loopback clients only: address it as localhost "
            "or 127.0.0.1 (a proxy in front of it needs --api-key, or --no-api-key on a closed network)",
            "permission_error",
        )
    if request.method == "POST" and route in BODY_ROUTES and cross_site_browser_request(request):
        return json_error(
            403,
            "a page of another site may not call this server from a browser; call the API from "
            "your server, or use this server's own page",
            "permission_error",
        )
    if (
        config.http.api_keys
        and (request.path.startswith(KEYED_PATH_PREFIXES) or route in BODY_ROUTES)
        and not authorized(request, config)
    ):  # the web demo's POST too: it decodes media
        return json_error(
            401,
            "missing or wrong API key; send 'Authorization: Bearer <key>'",
            "authentication_error",
        )
    if (encoding := unsupported_encoding(request)) is not None:
        response = json_error(415, unsupported_encoding_message(encoding), "invalid_request_error")
        # RFC 9110 15.5.16: a 415 for a content coding names the codings the server takes.
        response.headers["Accept-Encoding"] = ", ".join(SUPPORTED_ENCODINGS)
        return response
    if (
        request.method == "POST"
        and route in BODY_ROUTES
        and (content_type := not_json_content_type(request)) is not None
    ):
        return json_error(415, not_json_content_type_message(content_type), "invalid_request_error")
    return None


def authorized(request: web.Request, config: GatewayConfig) -> bool:
    token = bearer_token([("authorization", request.headers.get("Authorization", ""))])
    return any_key_matches(token, config.http.api_keys)
