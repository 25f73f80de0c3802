"""The front doors' admission bookkeeping on plain counters: per-client request slots, the
process-wide body-byte budget, and how both come back when a request ends."""

from __future__ import annotations

import grpc
import pytest

from epd.gateway.admission import (
    JSON_ALLOWANCE_BYTES,
    Admission,
    AdmissionLimits,
    Overloaded,
    max_body_bytes,
    peer_host,
)
from epd.gateway.config import GatewayConfig
from epd.transport.errors import status_of


def test_a_client_gets_at_most_its_slots_and_others_are_unaffected():
    admission = Admission(AdmissionLimits(max_requests_per_client=2, max_inflight_body_bytes=100))
    first, second = admission.admit("10.0.0.1"), admission.admit("10.0.0.1")
    with pytest.raises(Overloaded, match="--max-requests-per-client") as info:
        admission.admit("10.0.0.1")
    other = admission.admit("10.0.0.2")  # another client has its own slots
    assert admission.num_requests == 3
    assert info.value.retry_after_s >= 1

    first.close()
    third = admission.admit("10.0.0.1")  # a finished request gives its slot back
    for ticket in (second, third, other):
        ticket.close()
    assert admission.num_requests == 0 and admission.num_requests_of == {}


def test_the_byte_budget_is_shared_and_returned_when_the_request_ends():
    admission = Admission(AdmissionLimits(max_requests_per_client=8, max_inflight_body_bytes=100))
    a, b = admission.admit("a"), admission.admit("b")
    a.reserve_bytes(60)
    a.reserve_bytes(30)
    with pytest.raises(Overloaded, match="--max-inflight-body-bytes 100"):
        b.reserve_bytes(11)  # 90 + 11 > 100, whoever asks
    assert (admission.num_reserved_bytes, b.num_reserved_bytes) == (90, 0)  # a refusal reserves nothing
    b.reserve_bytes(10)
    assert admission.num_reserved_bytes == 100

    with a:
        pass  # the context manager closes the ticket
    a.close()  # closing twice gives back nothing twice
    assert admission.num_reserved_bytes == 10
    b.close()
    assert admission.num_reserved_bytes == 0
    with pytest.raises(RuntimeError, match="closed ticket"):
        b.reserve_bytes(1)


def test_overloaded_is_resource_exhausted_on_grpc():
    code, message = status_of(Overloaded("too many"))
    assert (code, message) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many")


def test_limits_derive_from_the_upload_limit_and_are_validated():
    assert max_body_bytes(300) == 400 + 4 + JSON_ALLOWANCE_BYTES
    limits = AdmissionLimits.for_gateway(300, 8, 0)
    assert limits.max_inflight_body_bytes == 2 * max_body_bytes(300)
    assert AdmissionLimits.for_gateway(300, 8, 5 << 20).max_inflight_body_bytes == 5 << 20
    with pytest.raises(ValueError, match="below the largest request body"):
        AdmissionLimits.for_gateway(300, 8, 1000)
    with pytest.raises(ValueError, match="--max-requests-per-client must be >= 1"):
        AdmissionLimits.for_gateway(300, 0, 0)
    defaults = Admission.of_gateway(GatewayConfig()).limits
    assert defaults.max_requests_per_client == 8
    assert defaults.max_inflight_body_bytes == 2 * max_body_bytes(GatewayConfig().max_upload_bytes)


@pytest.mark.parametrize(
    "peer,host",
    [
        ("ipv4:127.0.0.1:50123", "127.0.0.1"),
        ("ipv6:[::1]:50123", "::1"),
        ("ipv6:%5B::1%5D:50123", "::1"),
        ("unix:/tmp/sock", "unix"),
        ("10.1.2.3", "10.1.2.3"),
        ("::1", "::1"),
    ],
)
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host


def test_a_held_ticket_gives_back_its_slot_and_bytes_only_when_the_last_hold_is_released():
    """Work that outlives its handler (a web-demo decode whose client went away) keeps the
    request's slot and body bytes: `close()` (the handler ended) waits for every hold."""
    admission = Admission(AdmissionLimits(max_requests_per_client=1, max_inflight_body_bytes=100))
    ticket = admission.admit("a")
    ticket.reserve_bytes(60)
    release_one, release_two = ticket.hold(), ticket.hold()
    ticket.close()
    with pytest.raises(Overloaded, match="--max-requests-per-client"):
        admission.admit("a")
    assert admission.num_reserved_bytes == 60
    release_one()
    release_one()  # a second call does nothing: the other hold still counts
    assert admission.num_requests == 1 and admission.num_reserved_bytes == 60
    release_two()
    assert admission.num_requests == 0 and admission.num_reserved_bytes == 0
    admission.admit("a").close()
    with pytest.raises(RuntimeError, match="closed ticket"):
        ticket.hold()


def test_a_hold_released_before_close_leaves_close_to_give_back():
    admission = Admission(AdmissionLimits(max_requests_per_client=1, max_inflight_body_bytes=100))
    ticket = admission.admit("a")
    ticket.hold()()
    assert admission.num_requests == 1
    ticket.close()
    assert admission.num_requests == 0
