"""What the HTTP API refuses from browsers, whose pages can make requests their user never meant.

cross_site_browser_request   a POST that a page of another site or origin makes (its
                             Sec-Fetch-Site header, which browsers set and pages cannot):
                             with no CORS here it cannot read the answer, but it could make
                             a keyless gateway decode media and generate, blind, as often as
                             it liked
rebound_host                 on a keyless gateway on loopback, a request whose Host is not a
                             loopback name: a page whose domain was re-pointed at 127.0.0.1
                             (DNS rebinding) is same-origin with the gateway and could read
                             every answer. Loopback clients use
                             localhost, *.localhost, 127.x.y.z or [::1]; a proxy that passes
                             another Host serves beyond loopback, which needs an API key or
                             --no-api-key anyway (`config.open_without_key`).
"""

from __future__ import annotations

from aiohttp import web

from epd.gateway.config import GatewayConfig
from epd.stages.server_config import is_loopback


def cross_site_browser_request(request: web.Request) -> bool:
    return request.headers.get("Sec-Fetch-Site", "").lower() in ("cross-site", "same-site")


def rebound_host(request: web.Request, config: GatewayConfig) -> bool:
    if config.http.api_keys or config.http.no_api_key:
        return False  # keyed, or opened beyond loopback on purpose
    host = request.headers.get("Host")
    if host is None:
        return False  # HTTP/1.0 without Host: no browser sends that
    return not _loopback_name(host)


def _loopback_name(host: str) -> bool:
    """Whether a Host header ("name", "name:port", "[v6]:port") names this machine's loopback."""
    name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost") or is_loopback(name)
