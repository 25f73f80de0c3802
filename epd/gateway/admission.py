"""Admission at the front doors: how many requests one client keeps in flight, and how many
request-body bytes the whole gateway process holds at once. Plain counters, no gRPC, no HTTP:
both front doors (epd/gateway/http_api.py, epd/gateway/servicer.py) share one `Admission` per process.

A request's life here:

    ticket = admission.admit(client, key) # Overloaded if the client (peer IP) or its API key has
                                          # its maximum in flight
    ticket.reserve_bytes(n)               # Overloaded if the process budget cannot take n more;
                                          # called as the bytes arrive, never for bytes announced
    ...                                   # read the body, run the pipeline
    ticket.close()                        # gives back the slot and every byte reserved

A request counts once, whatever its `n` (OpenAI's and vLLM's choices): a default server then takes
any n up to epd's 16 (`MAX_CHOICES`) from any client, as vLLM takes any n up to its own bound,
while what one client holds stays bounded: --max-requests-per-client requests, each of at most 16
choices. Each choice is a decode request of its own, which reserves its decoder's KV room like any
other (decode's --kv-budget-bytes, and --max-waiting-requests for those waiting for it), so
choices meet the back-pressure of the memory they take. Counted as n requests, an n above the
per-client limit (8 by default) could never run.

Media an HTTP request names by local path or URL is reserved the same way as it is read
(`epd.gateway.media_fetch.load_media`). Body bytes stay reserved until the request ends, because the media they carry is held (as
bytes, then as the pipeline's input) for that long. Work a request started that outlives its
handler (a web-demo decode, whose thread runs on until it sees its cancel flag after the client
went away) holds the ticket: `release = ticket.hold()`, and `close()` gives the slot and bytes back
only once every hold is released, when that work has really ended.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote

from epd.stages.errors import Busy

if TYPE_CHECKING:
    from epd.gateway.config import GatewayConfig

JSON_ALLOWANCE_BYTES = 1 << 20
"""Room for the JSON around a data: URL (question, options) in an HTTP body."""

RETRY_AFTER_S = 1
"""What a refused client is told to wait before retrying (HTTP Retry-After), in seconds: slots
and bytes come back as soon as one request in flight ends."""


class Overloaded(Busy):
    """The front door's refusal for load (a client's requests in flight, the body bytes held):
    a `Busy` like a full stage queue, so RESOURCE_EXHAUSTED on gRPC and a 429 with Retry-After on
    HTTP. The message names the flag that tunes the limit."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message, retry_after_s)


def max_body_bytes(max_upload_bytes: int) -> int:
    """Largest HTTP request body for media of `max_upload_bytes`: base64 is 4/3 of the media
    (plus up to 4 bytes of padding), then the JSON around it."""
    return max_upload_bytes * 4 // 3 + 4 + JSON_ALLOWANCE_BYTES


@dataclass(frozen=True)
class AdmissionLimits:
    max_requests_per_client: int
    """Requests one client (peer IP) may have in flight on both front doors together."""
    max_inflight_body_bytes: int
    """Request-body bytes the process holds at once, over all requests."""
    max_requests_per_api_key: int = 0
    """Requests made with one API key may have in flight, whatever their peer addresses (a tenant
    spread over many IPs); 0 = no per-key limit beyond the per-IP one."""

    def __post_init__(self) -> None:
        if self.max_requests_per_client < 1:
            raise ValueError(f"--max-requests-per-client must be >= 1, got {self.max_requests_per_client}")
        if self.max_requests_per_api_key < 0:
            raise ValueError(
                f"--max-requests-per-api-key must be >= 0 (0 = no limit), got {self.max_requests_per_api_key}"
            )
        if self.max_inflight_body_bytes < 1:
            raise ValueError(f"--max-inflight-body-bytes must be >= 1, got {self.max_inflight_body_bytes}")

    @classmethod
    def for_gateway(
        cls,
        max_upload_bytes: int,
        max_requests_per_client: int,
        max_inflight_body_bytes: int,
        max_requests_per_api_key: int = 0,
    ) -> AdmissionLimits:
        """The gateway's limits; `max_inflight_body_bytes` 0 means two of the largest bodies.
        A budget below one largest body would refuse some valid requests forever."""
        largest = max_body_bytes(max_upload_bytes)
        budget = max_inflight_body_bytes or 2 * largest
        if budget < largest:
            raise ValueError(
                f"--max-inflight-body-bytes {budget} is below the largest request body ({largest} bytes "
                "for --max-upload-bytes); raise it or lower --max-upload-bytes"
            )
        return cls(max_requests_per_client, budget, max_requests_per_api_key)


class Admission:
    """Per-client request slots and the process-wide body-byte budget. Not thread-safe: used from
    the gateway's one event loop."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.num_requests_of: Counter[str] = Counter()
        self.num_requests_of_key: Counter[str] = Counter()
        """Requests in flight per API key, keyed by a digest of the key (never the key itself,
        so a memory dump or a debugger shows no secret)."""
        self.num_reserved_bytes = 0

    @classmethod
    def of_gateway(cls, config: GatewayConfig) -> Admission:
        """From the gateway's flags; one per process, shared by the HTTP and gRPC APIs."""
        limits = AdmissionLimits.for_gateway(
            config.max_upload_bytes,
            config.max_requests_per_client,
            config.max_inflight_body_bytes,
            config.max_requests_per_api_key,
        )
        return cls(limits)

    def admit(self, client: str, api_key: str = "") -> Ticket:
        """A slot for one request of `client` (peer IP) made with `api_key` ("" = none presented,
        or keys not required: then only the per-IP limit applies)."""
        if self.num_requests_of[client] >= self.limits.max_requests_per_client:
            raise Overloaded(
                f"this client already has {self.limits.max_requests_per_client} requests in flight; "
                "wait for one to finish (the server's limit is --max-requests-per-client)"
            )
        key_id = _key_id(api_key) if api_key and self.limits.max_requests_per_api_key else ""
        if key_id and self.num_requests_of_key[key_id] >= self.limits.max_requests_per_api_key:
            raise Overloaded(
                f"this API key already has {self.limits.max_requests_per_api_key} requests in flight; "
                "wait for one to finish (the server's limit is --max-requests-per-api-key)"
            )
        self.num_requests_of[client] += 1
        if key_id:
            self.num_requests_of_key[key_id] += 1
        return Ticket(self, client, key_id)

    @property
    def num_requests(self) -> int:
        return sum(self.num_requests_of.values())

    def _reserve(self, num_bytes: int) -> None:
        self._check_room(num_bytes)
        self.num_reserved_bytes += num_bytes

    def _check_room(self, num_bytes: int) -> None:
        if self.num_reserved_bytes + num_bytes > self.limits.max_inflight_body_bytes:
            raise Overloaded(
                f"the server is holding {self.num_reserved_bytes} bytes of request bodies and cannot "
                f"take {num_bytes} more now (its limit is --max-inflight-body-bytes "
                f"{self.limits.max_inflight_body_bytes}); retry shortly or send less"
            )

    def _release(self, client: str, num_bytes: int, key_id: str = "") -> None:
        self.num_reserved_bytes -= num_bytes
        self.num_requests_of[client] -= 1
        if self.num_requests_of[client] <= 0:
            del self.num_requests_of[client]  # the map holds only clients with requests in flight
        if key_id:
            self.num_requests_of_key[key_id] -= 1
            if self.num_requests_of_key[key_id] <= 0:
                del self.num_requests_of_key[key_id]


def _key_id(api_key: str) -> str:
    """What the per-key counter is keyed by: a digest, so the counter map holds no secret."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


class Ticket:
    """One admitted request: its client slot and the body bytes it reserved."""

    def __init__(self, admission: Admission, client: str, key_id: str = "") -> None:
        self._admission = admission
        self.client = client
        self.key_id = key_id
        self.num_reserved_bytes = 0
        self._num_holds = 0
        self._close_asked = False
        self._closed = False

    def reserve_bytes(self, num_bytes: int) -> None:
        """Reserve `num_bytes` more for this request, or raise Overloaded (nothing reserved)."""
        if self._close_asked:
            raise RuntimeError("reserve_bytes on a closed ticket")
        self._admission._reserve(num_bytes)
        self.num_reserved_bytes += num_bytes

    def check_room(self, num_bytes: int) -> None:
        """Overloaded unless the process budget could take `num_bytes` more now; reserves nothing
        (bytes are reserved as they arrive: a client that only announces a body holds none)."""
        self._admission._check_room(num_bytes)

    def hold(self) -> Callable[[], None]:
        """Keep the slot and the bytes past `close()` until the returned function is called (on
        the event loop; a second call does nothing): for work of this request that may outlive
        its handler."""
        if self._close_asked:
            raise RuntimeError("hold on a closed ticket")
        self._num_holds += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._num_holds -= 1
                self._give_back_if_done()

        return release

    def close(self) -> None:
        """Give back the slot and the bytes, at once or when the last hold is released; later
        calls do nothing."""
        self._close_asked = True
        self._give_back_if_done()

    def _give_back_if_done(self) -> None:
        if self._close_asked and not self._num_holds and not self._closed:
            self._closed = True
            self._admission._release(self.client, self.num_reserved_bytes, self.key_id)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def peer_host(peer: str) -> str:
    """The client's address without its port, from a gRPC peer string ('ipv4:1.2.3.4:5678',
    'ipv6:[::1]:5678', 'unix:/path') or an HTTP remote ('1.2.3.4', '::1')."""
    kind, sep, rest = unquote(peer).partition(":")
    if not sep or kind not in ("ipv4", "ipv6", "unix"):
        return peer  # already a bare address (aiohttp's request.remote)
    if kind == "unix":
        return "unix"
    if rest.startswith("["):  # ipv6:[::1]:port
        return rest[1:].partition("]")[0]
    return rest.rpartition(":")[0] or rest
