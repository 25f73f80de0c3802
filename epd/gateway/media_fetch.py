"""Turn the `url` of an OpenAI `video_url` / `image_url` content part into media bytes, under
the operator's policy (`MediaFetchConfig`):

    data:[<type>];base64,<payload>   always accepted (size-capped before decoding)
    /abs/path or file:///abs/path    only under `allowed_local_dir` (symlinks resolved first)
    http(s)://host/...               only for `allowed_domains`, never to a private, loopback or
                                     link-local address (every resolved address is checked, and
                                     the connection goes to exactly the checked addresses, so a
                                     second DNS answer cannot swap in 127.0.0.1; IPv6 forms that
                                     embed an IPv4 address are judged by it); redirects only to
                                     the same scheme, host and port; one deadline over the whole
                                     fetch (DNS, every hop, the body) and a byte cap.

Refusals raise `MediaRefused` (403 on HTTP); the other errors are `epd.transport.errors` ones.
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

import aiohttp
import idna
from aiohttp.abc import AbstractResolver, ResolveResult

from epd.gateway.config import MediaFetchConfig
from epd.stages.errors import DeadlineExceeded, InvalidRequest, NotFound, PermissionDenied, ResourceExhausted
from epd.transport.aio_cancel import within

_REDIRECT_STATUSES = (301, 302, 303, 307, 308)
_READ_CHUNK_BYTES = 1 << 16


class MediaRefused(PermissionDenied):
    """The media URL or path is not allowed by this server's policy."""


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Reserve = Callable[[int], None]
"""Takes `n` more bytes of media into the request's account, or raises (Overloaded) to refuse them."""


async def load_media(
    url: str, config: MediaFetchConfig, max_bytes: int, reserve: Reserve | None = None
) -> bytes:
    """The bytes behind `url`, at most `max_bytes` of them. A file's or a fetch's bytes are held
    like a request body's: `reserve(n)` (the request's admission ticket) is called before they
    are read (a file) or as they arrive (a fetch), and raises to refuse them (a data: URL's are
    the body's, reserved already)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("the media part needs a non-empty 'url'")
    if url.startswith("data:"):
        return await asyncio.to_thread(decode_data_url, url, max_bytes)
    scheme = _split(url).scheme.lower()
    if scheme in ("http", "https"):
        return await fetch_url(url, config, max_bytes, reserve)
    if scheme == "file" or url.startswith("/"):
        path = local_media_path(url, config.allowed_local_dir)
        num_bytes = path.stat().st_size
        if num_bytes > max_bytes:
            raise _too_large(max_bytes)
        if reserve is not None:
            reserve(num_bytes)  # here, on the event loop: the admission counters are the loop's
        return await asyncio.to_thread(_read_file, path, max_bytes)
    raise InvalidRequest(
        "media url must be a data: URL (data:video/mp4;base64,...), an http(s) URL, or an absolute "
        "local path / file:// URL"
    )


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError:  # e.g. an unclosed "[" of an IPv6 host
        raise InvalidRequest(
            "the media URL is malformed (an IPv6 host must be in brackets: http://[::1]:80/)"
        ) from None


# -- data: URLs ---------------------------------------------------------------------------------


def decode_data_url(url: str | bytes, max_bytes: int) -> bytes:
    """The media of a base64 data: URL, given as text or as its ASCII bytes (the HTTP API passes
    bytes so that a URL of hundreds of MB is not copied again): the payload is checked and decoded
    through a memoryview (no slice copy), and its size is refused before anything is decoded.

    CPU-bound (about 1 s per 64 MB of media) and holding the GIL inside each C call: the front
    doors run it on a worker thread (`load_media`, the HTTP API), and it checks and decodes
    `DATA_URL_PIECE_CHARS` at a time, so the event loop gets the GIL back between pieces. Decoded
    whole on the loop, one 64 MB upload held every other client's stream still for over a second."""
    if isinstance(url, str):
        try:
            url = url.encode("ascii")
        except UnicodeEncodeError:
            raise InvalidRequest("the data: URL must be ASCII: data:video/mp4;base64,<payload>") from None
    comma = url.find(b",")
    if comma < 0 or not url[len(b"data:") : comma].endswith(b";base64"):
        raise InvalidRequest("data: URLs must be base64, as in data:video/mp4;base64,<payload>")
    start, end = comma + 1, len(url)
    while start < end and url[start] in _ASCII_SPACE:
        start += 1
    while end > start and url[end - 1] in _ASCII_SPACE:
        end -= 1
    too_big = ResourceExhausted(
        f"the media is larger than this server accepts (at most {max_bytes} bytes, the server's "
        "--max-upload-bytes); send a shorter or more compressed video"
    )
    if (end - start) // 4 * 3 > max_bytes + 2:  # refused before decoding anything
        raise too_big
    pieces: list[bytes] = []
    with memoryview(url) as view:
        for at in range(start, end, DATA_URL_PIECE_CHARS):
            last = at + DATA_URL_PIECE_CHARS >= end
            payload = view[at : min(at + DATA_URL_PIECE_CHARS, end)]
            try:
                # What base64.b64decode(validate=True) checks, on the view instead of a copy;
                # padding only at the very end.
                if not (_BASE64 if last else _BASE64_NO_PADDING).fullmatch(payload):
                    raise InvalidRequest("the data: URL payload is not valid base64")
                pieces.append(binascii.a2b_base64(payload))
            except binascii.Error:
                raise InvalidRequest("the data: URL payload is not valid base64 (bad padding)") from None
            finally:
                payload.release()
    data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    del pieces
    if len(data) > max_bytes:
        raise too_big
    return data


DATA_URL_PIECE_CHARS = 1 << 20
"""Base64 characters checked and decoded per C call (a multiple of 4: every piece but the last
decodes on its own); about 2 ms each."""
_ASCII_SPACE = b" \t\n\r\x0b\x0c"
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_BASE64_NO_PADDING = re.compile(rb"[A-Za-z0-9+/]*")


# -- local files --------------------------------------------------------------------------------


def local_media_path(url: str, allowed_dir: str) -> Path:
    """The resolved path of a local media reference, if it lies under `allowed_dir`."""
    if not allowed_dir:
        raise MediaRefused(
            "local media paths are turned off on this server; send the media as a data: URL, or "
            "start the gateway with --allowed-local-media-path DIR"
        )
    if url.startswith("file:"):
        parts = _split(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequest("file:// URLs must name a local file (file:///abs/path)")
        raw = unquote(parts.path)
    else:
        raw = url
    if not os.path.isabs(raw):
        raise InvalidRequest("local media paths must be absolute")
    if "\x00" in raw:  # no file name holds one (os.path would raise ValueError)
        raise InvalidRequest("local media paths must not contain a NUL character")
    root = os.path.realpath(allowed_dir)
    real = os.path.realpath(raw)  # resolves symlinks and "..": what would really be opened
    if os.path.commonpath([real, root]) != root:
        raise MediaRefused(f"{raw} is outside the directory this server allows local media from")
    path = Path(real)
    if not path.exists():
        raise NotFound(f"no file at {raw}")
    if not path.is_file():
        raise InvalidRequest(f"{raw} is not a regular file")
    return path


def _read_file(path: Path, max_bytes: int) -> bytes:
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)  # at most: the file may have grown since its size was checked
    if len(data) > max_bytes:
        raise _too_large(max_bytes)
    return data


def _too_large(max_bytes: int) -> ResourceExhausted:
    return ResourceExhausted(f"the media is larger than this server accepts (at most {max_bytes} bytes)")


# -- http(s) URLs -------------------------------------------------------------------------------


# IPv6 forms that carry an IPv4 address: traffic to them reaches that IPv4 host (through a
# translator, a relay or the stack itself), so it is the IPv4 address that is judged.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix, IPv4 in the last 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215: local use, never public
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d


def is_public_address(ip: IpAddress) -> bool:
    """True for globally routable unicast addresses only; an IPv6 address that embeds an IPv4
    one (mapped, compatible, NAT64, 6to4, Teredo) is public only if the IPv4 address(es) are."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            return all(is_public_address(v4) for v4 in embedded)
        if ip in _NAT64_LOCAL or ip.is_site_local:  # fec0::/10: deprecated, but routed locally
            return False
    return ip.is_global and not ip.is_multicast


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address] | None:
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
    if ip.sixtofour is not None:
        return [ip.sixtofour]
    if ip.teredo is not None:
        return list(ip.teredo)  # (server, client): both are reached
    return None


def dns_host(host: str) -> str:
    """`host` as DNS and aiohttp spell it: lower case, no trailing dot, an internationalised name
    in its IDNA (punycode) form, encoded as yarl encodes the URL aiohttp connects to (UTS #46
    mapping, IDNA 2003 as its fallback), so the policy checks and pins the very name that is then
    resolved ("vidéos.example" -> "xn--vidos-dsa.example"). ValueError when it does not encode."""
    host = host.strip().rstrip(".").lower()
    if host.isascii():
        return host
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except UnicodeError:  # idna.IDNAError is one
        try:
            return host.encode("idna").decode("ascii")
        except UnicodeError:
            raise ValueError(f"{host!r} is not a valid internationalised domain name") from None


def host_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    """`host` is a listed domain or a subdomain of one (IP literals must be listed exactly).
    Both are compared in their `dns_host` form, so either spelling of an internationalised name
    matches either; an entry that does not encode matches nothing (the CLI refuses it at start)."""
    host = dns_host(host)
    for entry in allowed_domains:
        try:
            domain = dns_host(entry)
        except ValueError:
            continue
        if domain and (host == domain or host.endswith("." + domain)):
            return True
    return False


@dataclass(frozen=True)
class UrlTarget:
    scheme: str
    host: str
    port: int


def check_url(url: str, config: MediaFetchConfig) -> UrlTarget:
    """Scheme, host and port of an http(s) URL the policy allows (DNS not consulted yet)."""
    parts = _split(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidRequest("media URLs must be http or https")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise InvalidRequest("the media URL has an invalid port") from None
    if not host:
        raise InvalidRequest("the media URL has no host")
    try:
        # urlsplit leaves an internationalised name in Unicode; aiohttp resolves its punycode form.
        host = dns_host(host)
    except ValueError:
        raise InvalidRequest("the media URL's host is not a valid domain name") from None
    if not config.allowed_domains:
        raise MediaRefused(
            "fetching media from URLs is turned off on this server; send the media as a data: URL, "
            "or start the gateway with --allowed-media-domains"
        )
    if not host_allowed(host, config.allowed_domains):
        raise MediaRefused(
            f"media from {host} is not allowed on this server (not in --allowed-media-domains)"
        )
    literal = _ip_literal(host)
    if literal is not None and not config.allow_private_addresses and not is_public_address(literal):
        raise MediaRefused(f"media URLs must not point at a private, loopback or link-local address ({host})")
    return UrlTarget(scheme, host, port or (443 if scheme == "https" else 80))


def _ip_literal(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


async def resolve_checked(target: UrlTarget, config: MediaFetchConfig) -> list[tuple[str, int]]:
    """(address, family) of every address `target.host` resolves to; refused unless all are public."""
    literal = _ip_literal(target.host)
    if literal is not None:
        family = socket.AF_INET6 if literal.version == 6 else socket.AF_INET
        return [(str(literal), family)]
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except OSError:
        raise InvalidRequest(f"could not resolve the media host {target.host}") from None
    found: list[tuple[str, int]] = []
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if not config.allow_private_addresses and not is_public_address(ip):
            raise MediaRefused(
                f"{target.host} resolves to a private, loopback or link-local address; media URLs must be public"
            )
        if (str(ip), family) not in found:
            found.append((str(ip), family))
    if not found:
        raise InvalidRequest(f"could not resolve the media host {target.host}")
    return found


async def fetch_url(
    url: str, config: MediaFetchConfig, max_bytes: int, reserve: Reserve | None = None
) -> bytes:
    """One deadline (`fetch_timeout_s`) over the whole fetch: DNS, every hop and the body."""
    try:
        return await within(_fetch(url, config, max_bytes, reserve), config.fetch_timeout_s)
    except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
        raise DeadlineExceeded(
            f"fetching the media URL took longer than {config.fetch_timeout_s:g} s; send it as a data: URL"
        ) from None


async def _fetch(url: str, config: MediaFetchConfig, max_bytes: int, reserve: Reserve | None) -> bytes:
    target = check_url(url, config)
    addresses = await resolve_checked(target, config)
    connector = aiohttp.TCPConnector(resolver=_PinnedResolver(target.host, addresses), use_dns_cache=False)
    # No per-request timeout: aiohttp's would restart at each hop; fetch_url's deadline covers all.
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            for _ in range(config.max_redirects + 1):
                async with session.get(url, allow_redirects=False) as resp:
                    if resp.status in _REDIRECT_STATUSES:
                        url = _same_origin_redirect(url, resp.headers.get("Location", ""), target, config)
                        continue
                    if resp.status == 404:
                        raise NotFound("the media URL answered 404 Not Found")
                    if resp.status >= 400:
                        raise InvalidRequest(f"the media URL answered HTTP {resp.status}")
                    return await _read_capped(resp, max_bytes, reserve)
            raise InvalidRequest(f"the media URL redirected more than {config.max_redirects} times")
    except aiohttp.ClientError:
        raise InvalidRequest(f"could not fetch the media URL from {target.host}") from None


def _same_origin_redirect(url: str, location: str, target: UrlTarget, config: MediaFetchConfig) -> str:
    """Redirects keep scheme, host and port: another port on the same host is another service."""
    if not location:
        raise InvalidRequest("the media URL redirected without a Location")
    try:
        new_url = urljoin(url, location)
    except ValueError:  # the server's Location is malformed
        raise InvalidRequest("the media URL redirected to a malformed URL") from None
    new = check_url(new_url, config)
    if new != target:
        raise MediaRefused(
            "the media URL redirected to another scheme, host or port; only redirects on the same "
            "scheme, host and port are followed"
        )
    return new_url


async def _read_capped(resp, max_bytes: int, reserve: Reserve | None = None) -> bytes:
    too_large = _too_large(max_bytes)
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise too_large
    data = bytearray()
    async for chunk in resp.content.iter_chunked(_READ_CHUNK_BYTES):
        if len(data) + len(chunk) > max_bytes:
            raise too_large
        if reserve is not None:
            reserve(len(chunk))
        data += chunk
    return bytes(data)


class _PinnedResolver(AbstractResolver):
    """aiohttp resolver that answers only for the checked host, with the checked addresses: the
    connection cannot go anywhere the policy did not see."""

    def __init__(self, host: str, addresses: list[tuple[str, int]]) -> None:
        self.host = host
        self.addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            asked = dns_host(host)
        except ValueError:
            asked = ""
        if asked != self.host:
            raise OSError(f"{host} was not checked by the media policy")
        return [
            {
                "hostname": host,
                "host": addr,
                "port": port,
                "family": fam,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for addr, fam in self.addresses
        ]

    async def close(self) -> None:
        pass
