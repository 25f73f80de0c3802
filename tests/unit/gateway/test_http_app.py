"""The HTTP layer alone (in-process server, real sockets): body limit, API key, JSON errors for
aiohttp's own refusals, and /health. None of these requests reaches the pipeline."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from epd.gateway.config import GatewayConfig, HttpApiConfig
from epd.gateway.http_api import HttpApi
from epd.gateway.metrics import GatewayMetrics
from epd.gateway.pipeline import Pipeline

UPLOAD_LIMIT_BYTES = 1000

JSON = {"Content-Type": "application/json"}


async def _not_serving_decode() -> list[str]:
    return ["decode"]


async def _requests(api_key: str, fn, not_serving=None):
    config = GatewayConfig(
        max_upload_bytes=UPLOAD_LIMIT_BYTES,
        http=HttpApiConfig(port=0, api_keys=(api_key,) if api_key else ()),
    )
    metrics = GatewayMetrics()
    api = HttpApi(config, Pipeline(None, None, None), metrics, not_serving)  # type: ignore[arg-type]
    runner = web.AppRunner(api.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            return await fn(session), metrics
    finally:
        await runner.cleanup()


async def _status_and_json(resp: aiohttp.ClientResponse):
    return resp.status, await resp.json()


def test_body_over_the_limit_is_413_json():
    async def post_big(session):
        # The limit is max_upload_bytes * 4/3 (base64) + 1 MiB of JSON.
        async with session.post("/v1/chat/completions", data=b"x" * ((1 << 20) + 2000), headers=JSON) as resp:
            return await _status_and_json(resp)

    (status, body), metrics = asyncio.run(_requests("", post_big))
    assert status == 413
    assert body["error"]["type"] == "request_too_large"
    assert body["error"]["code"] == 413  # vLLM's: the HTTP status as an integer (it was null)
    assert metrics.value("epd_http_responses_total", route="/v1/chat/completions", code="413") == 1


def test_api_key_guards_v1_only():
    async def calls(session):
        out = []
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer k1"}):
            async with session.get("/v1/models", headers=headers) as resp:
                out.append(resp.status)
        async with session.get("/metrics") as resp:
            out.append(resp.status)
            assert "epd_http_responses_total" in await resp.text()
        return out

    statuses, _ = asyncio.run(_requests("k1", calls))
    assert statuses == [401, 401, 200, 200]


def test_api_key_answers_401_before_404_where_vllm_does():
    """vLLM's AuthenticationMiddleware guards /v1, /v2, /inference, /cohere and the prefixes of the
    routes it registers (/invocations, /tokenize) before routing: a client without the key learns
    nothing of what is served there. A path vLLM has only for pooling models, or in its dev mode,
    is a 404 there and here."""
    keyed = [
        "/v1/embeddings",
        "/v1/load_lora_adapter",
        "/v2/models",
        "/inference/v1/generate",
        "/invocations",
    ]
    keyed += ["/cohere/v2/chat", "/v1", "/tokenize"]
    open_ = ["/pooling", "/classify", "/score", "/rerank", "/sleep", "/reset_prefix_cache"]

    async def calls(session):
        out = {}
        for path in keyed + open_:
            async with session.post(path, json={}) as resp:
                out[path] = resp.status
        async with session.post("/invocations", json={}, headers={"Authorization": "Bearer k1"}) as resp:
            out["keyed /invocations"] = resp.status
        return out

    statuses, _ = asyncio.run(_requests("k1", calls))
    assert statuses == {**dict.fromkeys(keyed, 401), **dict.fromkeys(open_, 404), "keyed /invocations": 404}


def test_unknown_route_and_bad_json_are_json_errors():
    async def calls(session):
        async with session.get("/v2/nothing") as resp:
            missing = await _status_and_json(resp)
        async with session.post("/v1/chat/completions", data=b"{not json", headers=JSON) as resp:
            bad = await _status_and_json(resp)
        return missing, bad

    (missing, bad), _ = asyncio.run(_requests("", calls))
    assert missing[0] == 404 and "error" in missing[1]
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"] and bad[1]["error"]["code"] == 400


def test_a_body_not_sent_as_json_is_415_before_it_is_read():
    """Any Content-Type was read as JSON (vLLM refuses all but application/json): text/plain, form
    and multipart bodies are those a page of another site may POST without a CORS preflight, from
    a browser too old to send the Sec-Fetch-Site header the browser guard reads."""
    body = b'{"messages": []}'
    content_types = [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/octet-stream",
        None,
        "application/json; charset=utf-8",
        "Application/JSON",
    ]

    async def calls(session):
        out = []
        for content_type in content_types:
            headers = {"Content-Type": content_type} if content_type else {}
            for path in ("/v1/chat/completions", "/demo/frames"):
                # aiohttp adds application/octet-stream to bytes unless told to skip the header.
                async with session.post(
                    path,
                    data=body,
                    headers=headers,
                    skip_auto_headers=() if content_type else ("Content-Type",),
                ) as resp:
                    out.append((path, content_type, resp.status, (await resp.json())["error"]["message"]))
        return out

    results, metrics = asyncio.run(_requests("", calls))
    for path, content_type, status, message in results:
        if content_type in ("application/json; charset=utf-8", "Application/JSON"):
            # read: a bad body
            assert status == 400 and "Content-Type" not in message, (path, content_type, message)
        else:
            assert status == 415, (path, content_type, status)
            assert "must be JSON sent with 'Content-Type: application/json'" in message
            assert (
                f"got Content-Type '{content_type}'" if content_type else "got no Content-Type"
            ) in message
    assert metrics.value("epd_http_responses_total", route="/v1/chat/completions", code="415") == 5


def test_health_names_the_stages_not_serving():
    async def health(session):
        async with session.get("/health") as resp:
            return await _status_and_json(resp)

    (status, body), _ = asyncio.run(_requests("k1", health, _not_serving_decode))
    assert (status, body) == (503, {"status": "unavailable", "not_serving": ["decode"]})
    (status, body), _ = asyncio.run(_requests("k1", health))
    assert (status, body) == (200, {"status": "ok"})


def test_ping_is_health_and_version_names_epds_as_vllm_serves_them_without_a_key():
    """vLLM's /ping (SageMaker's probe, GET and POST) and /version were 404s."""
    from importlib.metadata import version

    async def calls(session):
        out = []
        for method, path in (("GET", "/ping"), ("POST", "/ping"), ("GET", "/version")):
            async with session.request(method, path) as resp:
                out.append(await _status_and_json(resp))
        return out

    down, _ = asyncio.run(_requests("k1", calls, _not_serving_decode))
    assert down[:2] == [(503, {"status": "unavailable", "not_serving": ["decode"]})] * 2
    up, _ = asyncio.run(_requests("k1", calls))
    assert up == [(200, {"status": "ok"})] * 2 + [(200, {"version": version("epd")})]


def test_retrieve_model_names_the_served_model_or_404():
    async def calls(session):
        out = []
        for path in ("/v1/models/epd", "/v1/models/other", "/v1/models/org/name"):
            async with session.get(path) as resp:
                out.append(await _status_and_json(resp))
        return out

    (served, other, slashed), _ = asyncio.run(_requests("", calls))
    assert served[0] == 200 and served[1]["id"] == "epd" and served[1]["object"] == "model"
    # vLLM's ModelCard fields: root (its weights' path there, the served name here), parent, permission
    card = served[1]
    assert (card["root"], card["parent"], card["owned_by"]) == ("epd", None, "epd")
    (permission,) = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {k: v for k, v in permission.items() if k not in ("id", "object", "created")} == {
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    assert other[0] == 404 and "model 'other' is not served here" in other[1]["error"]["message"]
    assert slashed[0] == 404 and "model 'org/name'" in slashed[1]["error"]["message"]
