"""Which prefill servers a decoder may pull KV caches from: the `--allow-kv-from` grammar.

A client names the KV source (`PrefillResult.kv_address`), so the address is untrusted text: it is
parsed as exactly one `HOST:PORT`, compared host-and-port against the operator's parsed entries,
and the gRPC target dialled is rebuilt from the parsed parts, so what was checked is what is
connected to.

    source   HOST:PORT     HOST  a DNS name, an IPv4 literal, or an IPv6 literal in brackets
                           PORT  1..65535
    entry    HOST:PORT     HOST  a DNS name (matches that exact name, case-insensitively; not the
                                 addresses it resolves to), an IPv4 literal or network
                                 (10.0.0.0/8), or an IPv6 literal or network in brackets
                                 ([::1], [fd00::/8]); IP literals compare by value (::1 is
                                 0:0:0:0:0:0:0:1), and an IPv4-mapped IPv6 source
                                 ([::ffff:10.0.0.5]) never matches an IPv4 entry
                           PORT  1..65535, or * for any port

Anything else is refused: gRPC schemes (ipv4:, dns:, unix:), lists, paths, a missing or
out-of-range port, an unbracketed IPv6 address, numeric host forms that only the resolver reads
as IPv4 (127.1, 0x7f000001).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ANY_PORT = 0
"""`port` of an entry written with `*`."""

_PORT = re.compile(r"[0-9]{1,5}")
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Resolvers read these final labels as parts of an IPv4 address (inet_aton: 127.1, 0x7f.1, 2130706433).
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")


@dataclass(frozen=True)
class KvSource:
    """A parsed KV source: a DNS name (`ip` None) or an IP literal."""

    host: str
    """Lower-case DNS name, or the IP address in its normal form."""
    ip: IpAddress | None
    port: int

    @property
    def grpc_target(self) -> str:
        """The target to dial, with an explicit scheme so gRPC does not re-interpret the text."""
        if self.ip is None:
            return f"dns:///{self.host}:{self.port}"
        if self.ip.version == 6:
            return f"ipv6:[{self.ip}]:{self.port}"
        return f"ipv4:{self.ip}:{self.port}"


@dataclass(frozen=True)
class AllowEntry:
    """One parsed `--allow-kv-from` entry: a DNS name (`network` None) or an IP network."""

    host: str
    network: IpNetwork | None
    port: int
    """ANY_PORT for `*`."""

    def admits(self, source: KvSource) -> bool:
        if self.port != ANY_PORT and self.port != source.port:
            return False
        if self.network is None or source.ip is None:
            return self.network is None and source.ip is None and self.host == source.host
        # Versions never mix: ::ffff:a.b.c.d is not a.b.c.d here (gRPC would dial it as IPv4, but
        # the operator listed an IPv4 entry, and one written form per address keeps this exact).
        return self.network.version == source.ip.version and source.ip in self.network


def parse_source(address: str) -> KvSource:
    """A client-given KV address as one HOST:PORT; ValueError (saying what is wrong) otherwise."""
    host, port_text = _split_host_port(address)
    port = _parse_port(port_text)
    if port is None:
        raise ValueError("the port must be a number in 1..65535")
    ip = _parse_ip(host, allow_network=False)
    if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return KvSource(str(ip), ip, port)
    return KvSource(_parse_name(host), None, port)


def parse_allow_entry(entry: str) -> AllowEntry:
    """One operator entry; ValueError naming the entry, the flag and the grammar otherwise."""
    try:
        host, port_text = _split_host_port(entry)
        port = ANY_PORT if port_text == "*" else _parse_port(port_text)
        if port is None:
            raise ValueError("the port must be a number in 1..65535, or *")
        if host == "*":
            raise ValueError(
                "there is no any-host wildcard: list the names, or an IP network such as 10.0.0.0/8"
            )
        ip = _parse_ip(host, allow_network=True)
        if ip is not None:
            network = ipaddress.ip_network(ip)
            return AllowEntry(str(network), network, port)
        return AllowEntry(_parse_name(host), None, port)
    except ValueError as exc:
        raise ValueError(
            f"--allow-kv-from entry {entry!r} is not valid: {exc}. Write HOST:PORT, HOST a DNS name, "
            "an IPv4 address or network (10.0.0.0/8) or an IPv6 address or network in brackets "
            "([::1], [fd00::/8]), PORT a number or * (e.g. 127.0.0.1:*,prefill:50052)"
        ) from None


def parse_allow_list(entries: tuple[str, ...]) -> tuple[AllowEntry, ...]:
    return tuple(parse_allow_entry(e) for e in entries)


def _split_host_port(text: str) -> tuple[str, str]:
    """(host, port text); a bracketed host keeps its brackets. Characters are checked later, by
    the IP / name / port parsers, which accept no `,`, `/` (outside a network) or scheme."""
    if text.startswith("["):
        inside, sep, port = text[1:].partition("]:")
        if not sep or "[" in inside or "]" in inside:
            raise ValueError("an IPv6 address must be written [ADDRESS]:PORT")
        return f"[{inside}]", port
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError("it needs a :PORT")
    if ":" in host:
        raise ValueError("one HOST:PORT only, no scheme (ipv4:, dns:), and an IPv6 address in brackets")
    return host, port


def _parse_port(text: str) -> int | None:
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        return None
    return int(text)


def _parse_ip(host: str, allow_network: bool) -> IpAddress | IpNetwork | None:
    """The IP address (or network, for entries) `host` writes, None for a name."""
    bracketed = host.startswith("[")
    text = host[1:-1] if bracketed else host
    if "/" in text and not allow_network:
        raise ValueError("a network is not an address")
    try:
        value: IpAddress | IpNetwork = (
            ipaddress.ip_network(text, strict=True) if "/" in text else ipaddress.ip_address(text)
        )
    except ValueError as exc:
        if "/" in text:
            raise ValueError(str(exc)) from None  # e.g. "10.244.3.17/16 has host bits set"
        if bracketed:
            raise ValueError("not an IPv6 address") from None
        return None
    if value.version == 6 and not bracketed:
        raise ValueError("an IPv6 address must be in brackets")
    if value.version == 4 and bracketed:
        raise ValueError("only IPv6 addresses go in brackets")
    if isinstance(value, ipaddress.IPv6Address) and value.scope_id:
        raise ValueError("IPv6 zone ids (%) are not accepted")
    return value


def _parse_name(host: str) -> str:
    name = host.lower()
    name = name[:-1] if name.endswith(".") else name
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError("not a DNS name or IP address")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        raise ValueError("a numeric host must be a dotted-quad IPv4 address")
    return name
