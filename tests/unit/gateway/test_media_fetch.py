"""The media URL/path policy of the HTTP API: what it accepts, what it refuses, and that fetches
obey the whole-fetch deadline, the size cap and the same-origin redirect rule (against a real loopback server,
with `allow_private_addresses` on only for that)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import threading

import pytest
from aiohttp import web
from yarl import URL

from epd.gateway import media_fetch
from epd.gateway.config import MediaFetchConfig
from epd.gateway.media_fetch import (
    MediaRefused,
    _PinnedResolver,
    check_url,
    decode_data_url,
    host_allowed,
    is_public_address,
    load_media,
    local_media_path,
    resolve_checked,
)
from epd.stages.errors import DeadlineExceeded, InvalidRequest, NotFound, ResourceExhausted

# -- data: URLs


def test_data_url_round_trip():
    payload = bytes(range(256)) * 3
    url = "data:video/mp4;base64," + base64.b64encode(payload).decode()
    assert decode_data_url(url, max_bytes=len(payload)) == payload


def test_data_url_must_be_base64():
    with pytest.raises(InvalidRequest, match="must be base64"):
        decode_data_url("data:video/mp4,rawbytes", 100)
    with pytest.raises(InvalidRequest, match="not valid base64"):
        decode_data_url("data:video/mp4;base64,@@@@", 100)


def test_data_url_over_the_cap_is_refused_before_decoding():
    with pytest.raises(ResourceExhausted, match="at most 1000 bytes"):
        decode_data_url("data:video/mp4;base64," + "A" * 4000, 1000)
    exact = base64.b64encode(b"x" * 1001).decode()
    with pytest.raises(ResourceExhausted, match="at most 1000 bytes"):
        decode_data_url("data:video/mp4;base64," + exact, 1000)


@pytest.fixture
def a2b_calls(monkeypatch):
    """Every base64 piece the data: URL decoder hands to binascii: its length and its thread."""
    calls: list[tuple[int, int]] = []

    class Recording:
        Error = binascii.Error

        @staticmethod
        def a2b_base64(data):
            calls.append((len(data), threading.get_ident()))
            return binascii.a2b_base64(data)

    monkeypatch.setattr(media_fetch, "binascii", Recording)
    return calls


def test_a_data_url_is_checked_and_decoded_a_piece_at_a_time(monkeypatch, a2b_calls):
    """Decoded in one C call, which holds the GIL, a 64 MB upload stopped the event loop (every
    other client's stream) for over a second; between pieces the loop gets the GIL back."""
    monkeypatch.setattr(media_fetch, "DATA_URL_PIECE_CHARS", 8)
    for size in range(0, 40):
        payload = os.urandom(size)
        assert decode_data_url("data:video/mp4;base64," + base64.b64encode(payload).decode(), 100) == payload
    assert a2b_calls and max(n for n, _ in a2b_calls) == 8
    with pytest.raises(InvalidRequest, match="not valid base64"):
        decode_data_url("data:video/mp4;base64,AAAA==AAAAAAAAAA", 100)  # padding inside, not at the end
    with pytest.raises(InvalidRequest, match="bad padding"):
        decode_data_url("data:video/mp4;base64,AAAAAAAAAA", 100)


def test_load_media_decodes_a_data_url_off_the_event_loop(a2b_calls):
    async def load():
        return await load_media("data:video/mp4;base64,AAAA", MediaFetchConfig(), 100)

    assert asyncio.run(load()) == b"\0\0\0"
    assert a2b_calls and all(thread != threading.get_ident() for _, thread in a2b_calls)


# -- local paths


@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "clip.mp4").write_bytes(b"video bytes")
    (tmp_path / "secret.txt").write_bytes(b"not for clients")
    return allowed


def test_local_paths_are_off_by_default(media_dir):
    with pytest.raises(MediaRefused, match="--allowed-local-media-path"):
        local_media_path(str(media_dir / "clip.mp4"), "")


def test_local_path_and_file_url_inside_the_allowed_dir(media_dir):
    inside = media_dir / "clip.mp4"
    assert local_media_path(str(inside), str(media_dir)) == inside.resolve()
    assert local_media_path(inside.as_uri(), str(media_dir)) == inside.resolve()
    data = asyncio.run(load_media(inside.as_uri(), MediaFetchConfig(allowed_local_dir=str(media_dir)), 100))
    assert data == b"video bytes"


@pytest.mark.parametrize("relative", ["../secret.txt", "./../allowed/../secret.txt"])
def test_dot_dot_escape_is_refused(media_dir, relative):
    with pytest.raises(MediaRefused, match="outside the directory"):
        local_media_path(f"{media_dir}/{relative}", str(media_dir))


def test_symlink_out_of_the_allowed_dir_is_refused(media_dir):
    link = media_dir / "link.mp4"
    os.symlink(media_dir.parent / "secret.txt", link)
    with pytest.raises(MediaRefused, match="outside the directory"):
        local_media_path(str(link), str(media_dir))


def test_sibling_dir_with_the_same_prefix_is_refused(media_dir):
    sibling = media_dir.parent / "allowed_other"
    sibling.mkdir()
    (sibling / "x.mp4").write_bytes(b"x")
    with pytest.raises(MediaRefused, match="outside the directory"):
        local_media_path(str(sibling / "x.mp4"), str(media_dir))


def test_local_path_errors(media_dir):
    with pytest.raises(NotFound, match="no file at"):
        local_media_path(str(media_dir / "absent.mp4"), str(media_dir))
    with pytest.raises(InvalidRequest, match="not a regular file"):
        local_media_path(str(media_dir), str(media_dir))
    with pytest.raises(InvalidRequest, match="must name a local file"):
        local_media_path("file://otherhost/clip.mp4", str(media_dir))
    config = MediaFetchConfig(allowed_local_dir=str(media_dir))
    with pytest.raises(ResourceExhausted, match="at most 4 bytes"):
        asyncio.run(load_media(str(media_dir / "clip.mp4"), config, 4))
    with pytest.raises(InvalidRequest, match="must be a data: URL"):
        asyncio.run(load_media("clip.mp4", config, 100))


@pytest.mark.parametrize(
    "url", ["http://[::1", "https://[zz]/a.mp4", "file://[x", "//[", "http://[::1/x.mp4"]
)
def test_a_malformed_url_is_a_bad_request_whatever_the_policy(media_dir, url):
    """urlsplit raises ValueError on an unclosed or invalid IPv6 host; that is the client's error
    (it was an internal error, HTTP 500), whether URLs and local paths are allowed or not."""
    for config in (
        MediaFetchConfig(),
        MediaFetchConfig(allowed_local_dir=str(media_dir), allowed_domains=("a.com",)),
    ):
        with pytest.raises(InvalidRequest, match="malformed"):
            asyncio.run(load_media(url, config, 100))


def test_a_nul_character_in_a_local_path_is_a_bad_request(media_dir):
    for url in (str(media_dir / "clip\x00.mp4"), f"file://{media_dir}/clip%00.mp4"):
        with pytest.raises(InvalidRequest, match="NUL character"):
            local_media_path(url, str(media_dir))


# -- addresses and domains


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
        "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::",
        # IPv6 forms that embed a private IPv4 address: judged by that address
        "64:ff9b::7f00:1", "64:ff9b::a00:5",  # NAT64 well-known prefix -> 127.0.0.1, 10.0.0.5
        "2002:7f00:1::1", "2002:c0a8:101::1",  # 6to4 -> 127.0.0.1, 192.168.1.1
        "::127.0.0.1", "::10.0.0.5",  # IPv4-compatible
        "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo, client ~0x80fffffe = 127.0.0.1
        "2001:0:a00:5:8000:63bf:f7f7:f7f7",  # Teredo via a private server 10.0.0.5, client 8.8.8.8
        # never public whatever they embed
        "64:ff9b:1::808:808",  # local-use NAT64 (RFC 8215)
        "fec0::1", "fec0:1::8.8.8.8",  # site-local
    ],
)  # fmt: skip
def test_non_public_addresses(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
        "64:ff9b::808:808", "2002:808:808::1", "::8.8.8.8",  # NAT64, 6to4, compatible -> 8.8.8.8
        "2001:0:4136:e378:8000:63bf:f7f7:f7f7",  # Teredo: server 65.54.227.120, client 8.8.8.8
    ],
)  # fmt: skip
def test_public_addresses(address):
    assert is_public_address(ipaddress.ip_address(address))


def test_host_allowed_matches_domains_and_subdomains_only():
    domains = ("a.com", "B.org")
    assert host_allowed("a.com", domains)
    assert host_allowed("cdn.a.com", domains)
    assert host_allowed("A.COM.", domains)
    assert host_allowed("x.b.org", domains)
    assert not host_allowed("evila.com", domains)
    assert not host_allowed("a.com.evil.org", domains)
    assert not host_allowed("a.com", ())


def test_check_url_policy():
    with pytest.raises(MediaRefused, match="turned off"):
        check_url("https://a.com/x.mp4", MediaFetchConfig())
    config = MediaFetchConfig(allowed_domains=("a.com", "10.0.0.5", "8.8.8.8"))
    with pytest.raises(MediaRefused, match="not in --allowed-media-domains"):
        check_url("https://b.com/x.mp4", config)
    with pytest.raises(MediaRefused, match="private, loopback or link-local"):
        check_url("http://10.0.0.5/x.mp4", config)
    with pytest.raises(InvalidRequest, match="http or https"):
        check_url("ftp://a.com/x.mp4", config)
    target = check_url("https://cdn.a.com/x.mp4", config)
    assert (target.scheme, target.host, target.port) == ("https", "cdn.a.com", 443)
    assert check_url("http://8.8.8.8:8080/x", config).port == 8080


@pytest.mark.parametrize("listed", ["vidéos.example", "xn--vidos-dsa.example", "VIDÉOS.Example."])
@pytest.mark.parametrize(
    "url",
    [
        "https://vidéos.example/clip.mp4",
        "https://xn--vidos-dsa.example/clip.mp4",
        "https://cdn.Vidéos.example/clip.mp4",
    ],
)
def test_an_internationalised_domain_is_allowed_in_either_spelling(listed, url):
    """The policy checks and pins the punycode name that aiohttp (yarl) then resolves: a Unicode
    host used to be pinned as Unicode, and the connection's lookup of its punycode form refused."""
    target = check_url(url, MediaFetchConfig(allowed_domains=(listed,)))
    assert target.host.endswith("xn--vidos-dsa.example") and target.host.isascii()
    assert target.host == URL(url).raw_host.lower()
    resolver = _PinnedResolver(target.host, [("93.184.215.14", 2)])
    answers = asyncio.run(resolver.resolve(URL(url).raw_host, 443))
    assert [a["host"] for a in answers] == ["93.184.215.14"]
    with pytest.raises(MediaRefused, match="not in --allowed-media-domains"):
        check_url("https://videos.example/clip.mp4", MediaFetchConfig(allowed_domains=(listed,)))


def test_a_host_that_is_not_a_domain_name_is_refused():
    config = MediaFetchConfig(allowed_domains=("a.com",))
    with pytest.raises(InvalidRequest, match="not a valid domain name"):
        check_url(f"https://{'é' * 70}.a.com/x.mp4", config)  # a label of over 63 ASCII characters
    assert not host_allowed("a.com", ("a.com" + "é" * 70,))  # an entry that does not encode matches nothing


def test_a_name_resolving_to_loopback_is_refused():
    config = MediaFetchConfig(allowed_domains=("localhost",))
    target = check_url("http://localhost:9/x.mp4", config)
    with pytest.raises(MediaRefused, match="resolves to a private"):
        asyncio.run(resolve_checked(target, config))


# -- fetching (real loopback server; private addresses allowed for these tests only)


async def _with_server(routes, fn):
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        return await fn(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def _run_fetch(routes, path, max_bytes=1000, host="127.0.0.1", reserve=None, **config_kwargs):
    config = MediaFetchConfig(
        allowed_domains=("127.0.0.1", "localhost"), allow_private_addresses=True, **config_kwargs
    )
    return asyncio.run(
        _with_server(
            routes, lambda port: load_media(f"http://{host}:{port}{path}", config, max_bytes, reserve)
        )
    )


async def _video(request):
    return web.Response(body=b"v" * 500)


async def _big_streamed(request):
    resp = web.StreamResponse()  # chunked: no Content-Length to trust
    await resp.prepare(request)
    for _ in range(10):
        await resp.write(b"b" * 500)
    return resp


async def _redirect_same_host(request):
    raise web.HTTPFound("/video")


async def _redirect_other_host(request):
    raise web.HTTPFound(f"http://localhost:{request.url.port}/video")


async def _slow(request):
    await asyncio.sleep(2)
    return web.Response(body=b"late")


# Each hop takes ~0.4 s, well under a 1 s timeout; the fetch as a whole takes ~1.2 s.
_HOP_S = 0.4


async def _slow_redirect_1(request):
    await asyncio.sleep(_HOP_S)
    raise web.HTTPFound("/slow-redirect-2")


async def _slow_redirect_2(request):
    await asyncio.sleep(_HOP_S)
    raise web.HTTPFound("/trickle")


async def _trickle(request):
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(8):
        await resp.write(b"t")
        await asyncio.sleep(_HOP_S / 8)
    return resp


ROUTES = {
    "/video": _video,
    "/big": _big_streamed,
    "/same": _redirect_same_host,
    "/other": _redirect_other_host,
    "/slow": _slow,
    "/slow-redirect-1": _slow_redirect_1,
    "/slow-redirect-2": _slow_redirect_2,
    "/trickle": _trickle,
}


def test_fetch_and_same_host_redirect():
    assert _run_fetch(ROUTES, "/video") == b"v" * 500
    assert _run_fetch(ROUTES, "/same") == b"v" * 500


def test_redirect_to_another_host_is_refused():
    with pytest.raises(MediaRefused, match="another scheme, host or port"):
        _run_fetch(ROUTES, "/other")


def test_a_redirect_to_a_malformed_url_is_a_bad_request():
    async def redirect(request):  # web.HTTPFound would check the URL itself
        return web.Response(status=302, headers={"Location": "http://[::1/elsewhere"})

    with pytest.raises(InvalidRequest, match="redirected to a malformed URL"):
        _run_fetch({"/redirect": redirect}, "/redirect")


def test_redirect_to_another_port_on_the_same_host_is_refused():
    """Private addresses are allowed here, so only the same-port rule stands between the fetch
    and the other local service (which really listens, and would answer)."""

    async def other_service(request):
        return web.Response(body=b"another local service")

    async def fetch(other_port):
        async def redirect(request):
            raise web.HTTPFound(f"http://127.0.0.1:{other_port}/secret")

        config = MediaFetchConfig(allowed_domains=("127.0.0.1",), allow_private_addresses=True)
        return await _with_server(
            {"/redirect": redirect},
            lambda port: load_media(f"http://127.0.0.1:{port}/redirect", config, 1000),
        )

    with pytest.raises(MediaRefused, match="another scheme, host or port"):
        asyncio.run(_with_server({"/secret": other_service}, fetch))


def test_fetch_size_cap():
    with pytest.raises(ResourceExhausted, match="at most 100 bytes"):
        _run_fetch(ROUTES, "/video", max_bytes=100)  # refused on Content-Length
    with pytest.raises(ResourceExhausted, match="at most 1000 bytes"):
        _run_fetch(ROUTES, "/big", max_bytes=1000)  # refused while reading


def test_fetched_and_local_media_count_against_the_body_budget(media_dir):
    """Only a body's bytes were counted: media read from a file or a URL (the larger part of such
    a request) was held outside --max-inflight-body-bytes."""
    reserved: list[int] = []
    assert _run_fetch(ROUTES, "/big", max_bytes=6000, reserve=reserved.append) == b"b" * 5000
    assert sum(reserved) == 5000
    reserved.clear()
    local = MediaFetchConfig(allowed_local_dir=str(media_dir))
    assert asyncio.run(load_media(str(media_dir / "clip.mp4"), local, 100, reserved.append)) == b"video bytes"
    assert reserved == [len(b"video bytes")]

    def refuse(num_bytes):
        raise ResourceExhausted(f"no room for {num_bytes}")

    with pytest.raises(ResourceExhausted, match="no room for 11"):
        asyncio.run(load_media(str(media_dir / "clip.mp4"), local, 100, refuse))
    with pytest.raises(ResourceExhausted, match="no room for"):
        _run_fetch(ROUTES, "/big", max_bytes=6000, reserve=refuse)


def test_fetch_timeout_and_not_found():
    with pytest.raises(DeadlineExceeded, match="longer than 0.3 s"):
        _run_fetch(ROUTES, "/slow", fetch_timeout_s=0.3)
    with pytest.raises(NotFound, match="404"):
        _run_fetch(ROUTES, "/absent")


def test_one_deadline_covers_every_hop_and_the_body():
    """Two slow redirects then a trickled body: no hop alone reaches 1 s, all together do."""
    assert _run_fetch(ROUTES, "/trickle", fetch_timeout_s=30) == b"t" * 8
    with pytest.raises(DeadlineExceeded, match="longer than 1 s"):
        _run_fetch(ROUTES, "/slow-redirect-1", fetch_timeout_s=1.0)


def test_fetch_of_private_address_is_refused_by_default():
    config = MediaFetchConfig(allowed_domains=("127.0.0.1",))

    async def fetch(port):
        return await load_media(f"http://127.0.0.1:{port}/video", config, 1000)

    with pytest.raises(MediaRefused, match="private, loopback or link-local"):
        asyncio.run(_with_server(ROUTES, fetch))


def test_an_allow_list_entry_that_is_not_a_domain_name_is_refused_at_start():
    from epd.cli import configs
    from epd.cli.parsers.root import build_parser

    args = build_parser().parse_args(
        ["serve", "gateway", "--allowed-media-domains", "a.com," + "é" * 70 + ".org"]
    )
    with pytest.raises(
        ValueError, match="--allowed-media-domains: .* not a valid internationalised domain name"
    ):
        configs.gateway_config(args)
    args = build_parser().parse_args(["serve", "gateway", "--allowed-media-domains", "vidéos.example"])
    # matched by `dns_host`
    assert configs.gateway_config(args).http.media.allowed_domains == ("vidéos.example",)
