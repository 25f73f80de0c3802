"""`dns:///NAME:PORT` stage addresses: the gateway looks NAME up itself and routes over one replica
per address it finds (`IP:PORT`, an IPv6 address in brackets), each on its own channel, exactly as
if the addresses had been listed. In Kubernetes NAME is a stage's headless Service and the
addresses are its ready pods, so the router's media affinity, load-aware choice, retries on a
sibling and holding back of a failed replica see every pod. Given to gRPC as one target instead,
the name was one replica to the router and gRPC's round_robin spread the calls blindly: a video's
follow-ups missed the caches that held it, and a failed pod was never held back.

Pure bookkeeping (no gRPC; the lookups are the caller's): `ReplicaSets` holds each stage's entries
as configured (the --encoder/--prefill/--decode flags, or the replica file) and the last good
lookup of each name; `expanded(stage)` is the list that stage's pool routes over.
`epd.gateway.replica_list.ReplicaUpdater` looks the names up (getaddrinfo off the event loop, every
`--dns-refresh-interval` seconds) and applies the lists to the pools, by the same path a reloaded
replica file takes.

A lookup that fails, or finds no address, changes nothing that routes:
- a name never found yet stays in its stage's list as written, and gets no call, health check or
  load read (`epd.transport.replica_pool.unresolved`): a stage with nothing else is not serving,
  and the gateway NOT_SERVING. It is looked up again every PENDING_RETRY_S. Not an error at
  start-up: a headless Service has no address until one of its pods is ready, and the gateway
  starts in seconds while the stages load their models for minutes; a gateway that exited then
  was restarted in a loop (CrashLoopBackOff) until they had. Dialled as written instead (gRPC's
  resolver), its health check answered SERVING and the calls went to whichever pod gRPC picked,
  past the router, with TLS to pods whose advertised IPs had no name to be checked against;
- a name found before keeps its last good addresses: a DNS blip must not empty a stage (the health
  checks take addresses that stopped serving out of routing).
Each change of a name's state (failing, found again) is one line for the log, not one per lookup.

Only `dns:///` (no authority) is expanded. Any other target, a plain `NAME:PORT` included, is one
replica dialled as written: gRPC resolves a plain name itself and balances over its addresses, the
choice for a name that stands for one endpoint (a ClusterIP Service, a load balancer).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

DNS_PREFIX = "dns:///"

DNS_REFRESH_INTERVAL_S = 10.0
"""Default seconds between lookups of every `dns:///` name (`--dns-refresh-interval`). A new pod
gets calls within about this long of turning ready (before, with gRPC resolving the name, only
when some connection ended: up to the stages' 5-minute connection age). Gone pods need no lookup
to leave routing (their calls fail and the 1 s health checks take them out), so this only paces
scale-ups: 10 s is Envoy's and SGLang's order of magnitude (Envoy's STRICT_DNS refreshes every 5 s)
while a lookup of a handful of names every 10 s costs the DNS server nothing; gRPC's own resolver
waits at least 30 s between lookups."""

PENDING_RETRY_S = 1.0
"""Seconds between lookups of a name not found yet (at start-up the stages' pods are not ready),
so that the gateway routes over them about as soon as its health checks would see them serve."""

Lookup = Callable[[str, int], Sequence[str]]
"""(host, port) -> the IP addresses of host; raises OSError when the lookup fails."""

_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]")


def getaddrinfo_lookup(host: str, port: int) -> list[str]:
    """The system resolver's addresses for `host` (IPv4 and IPv6; /etc/hosts included). Blocks:
    run it off the event loop."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


@dataclass(frozen=True)
class DnsName:
    """A `dns:///HOST:PORT` entry, parsed."""

    host: str
    """The name looked up (lower-case), or an IP literal without brackets."""
    port: int

    @property
    def entry(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{DNS_PREFIX}{host}:{self.port}"

    @property
    def server_name(self) -> str:
        """The name the TLS certificates of its addresses are checked against: what the operator
        wrote (an IP literal is dialled as such, and checked as such)."""
        return "" if ":" in self.host or self.host.replace(".", "").isdigit() else self.host


def parse_dns_entry(entry: str) -> DnsName | None:
    """The name of a `dns:///HOST:PORT` entry; None for any other address (dialled as written);
    ValueError (saying what to write) for a `dns:///` entry without a usable HOST:PORT."""
    if not entry.startswith(DNS_PREFIX):
        return None
    host, sep, port = entry[len(DNS_PREFIX) :].rpartition(":")
    if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"stage address {entry!r} is not dns:///NAME:PORT (e.g. dns:///encoder-headless:50051; an "
            "IPv6 address in brackets, the port 1..65535)"
        )
    return DnsName(host.strip("[]").lower(), int(port))


def replica_address(ip: str, port: int) -> str:
    """The `IP:PORT` gRPC target of one found address (an IPv6 address in brackets)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass(frozen=True)
class StageList:
    """What one stage's pool routes over."""

    addresses: tuple[str, ...]
    server_names: dict[str, str] = field(default_factory=dict)
    """address -> the DNS name it was found under, for the TLS check (`DnsName.server_name`)."""


class ReplicaSets:
    """Each stage's entries as configured, and the last good lookup of every `dns:///` name among
    them. `configured` may be changed (`configure`: a reloaded replica file); lookups are recorded
    (`record`) as they come, and `expanded(stage)` gives the list to route over now."""

    def __init__(self, configured: Mapping[str, Sequence[str]]) -> None:
        self.configured: dict[str, tuple[str, ...]] = {}
        self._found: dict[DnsName, tuple[str, ...]] = {}
        """The addresses of each name's last good lookup (`IP:PORT`, sorted)."""
        self._failing: set[DnsName] = set()
        """Names whose last lookup failed or found nothing (the state the log has been told)."""
        self.configure(configured)

    def configure(self, lists: Mapping[str, Sequence[str]]) -> None:
        """Replace the entries of the stages in `lists` (ValueError for a malformed `dns:///`
        entry, nothing changed); what is known of names no stage lists any more is forgotten."""
        for entries in lists.values():
            for entry in entries:
                parse_dns_entry(entry)
        self.configured.update({stage: tuple(entries) for stage, entries in lists.items()})
        names = set(self.names())
        self._found = {n: found for n, found in self._found.items() if n in names}
        self._failing &= names

    def names(self) -> list[DnsName]:
        """Every `dns:///` name the stages list, once each."""
        parsed = (parse_dns_entry(e) for entries in self.configured.values() for e in entries)
        return list(dict.fromkeys(n for n in parsed if n is not None))

    def pending(self) -> list[DnsName]:
        """Names never found yet (no calls meanwhile)."""
        return [n for n in self.names() if n not in self._found]

    def never_looked_up(self) -> list[DnsName]:
        """Names neither found nor failed yet: those a reloaded replica file just named."""
        return [n for n in self.names() if n not in self._found and n not in self._failing]

    def record(self, name: DnsName, found: Sequence[str] | OSError) -> str | None:
        """One lookup's outcome: the IP addresses found, or the OSError it raised. Returns a line
        for the log when the name's state changed (it stopped resolving, or resolved again). A name
        no stage lists any more (the replica file changed during the lookup) is not recorded."""
        if name not in self.names():
            return None
        if isinstance(found, OSError) or not found:
            why = (
                "resolves to no address"
                if not isinstance(found, OSError)
                else (f"does not resolve ({found.strerror or found})")
            )
            if name in self._failing:
                return None
            self._failing.add(name)
            if name in self._found:
                return (
                    f"{name.entry} {why}: keeping its last addresses {', '.join(self._found[name])} "
                    "until a lookup finds some"
                )
            return (
                f"{name.entry} {why} yet: no calls go to it until a lookup finds its addresses, "
                f"retried every {PENDING_RETRY_S:g} s"
            )
        self._found[name] = tuple(sorted({replica_address(ip, name.port) for ip in found}))
        if name in self._failing:
            self._failing.discard(name)
            return f"{name.entry} resolves again: {', '.join(self._found[name])}"
        return None

    def expanded(self, stage: str) -> StageList:
        """The stage's replicas now: each `dns:///` name found replaced by its addresses (the first
        entry naming an address wins it), every other entry as written (a name not found yet too:
        the pool calls nothing there, `epd.transport.replica_pool.unresolved`)."""
        addresses: dict[str, None] = {}
        server_names: dict[str, str] = {}
        for entry in self.configured[stage]:
            name = parse_dns_entry(entry)
            if name is None or name not in self._found:
                addresses.setdefault(entry)
                continue
            for address in self._found[name]:
                if address not in addresses:
                    addresses[address] = None
                    if name.server_name:
                        server_names[address] = name.server_name
        return StageList(tuple(addresses), server_names)
