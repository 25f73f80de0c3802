"""The per-API-key concurrency limit (--max-requests-per-api-key): one tenant spread over many
peer addresses still gets at most its slots; other keys and key-less requests are unaffected."""

from __future__ import annotations

import grpc
import pytest

from epd.gateway.admission import Admission, AdmissionLimits, Overloaded
from epd.gateway.config import GatewayConfig
from epd.transport.errors import status_of


def _admission(per_key: int) -> Admission:
    return Admission(
        AdmissionLimits(
            max_requests_per_client=8, max_inflight_body_bytes=100, max_requests_per_api_key=per_key
        )
    )


def test_one_key_over_many_addresses_gets_at_most_its_slots():
    admission = _admission(per_key=2)
    first, second = admission.admit("10.0.0.1", "key-a"), admission.admit("10.0.0.2", "key-a")
    with pytest.raises(Overloaded, match="--max-requests-per-api-key") as info:
        admission.admit("10.0.0.3", "key-a")
    assert status_of(info.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.retry_after_s >= 1
    assert "key-a" not in str(info.value)  # the refusal never echoes the secret
    assert admission.num_requests_of == {"10.0.0.1": 1, "10.0.0.2": 1}  # the refused one held nothing

    other_key = admission.admit("10.0.0.3", "key-b")
    no_key = admission.admit("10.0.0.3")
    first.close()
    third = admission.admit("10.0.0.3", "key-a")  # a finished request gives its key slot back
    for ticket in (second, third, other_key, no_key):
        ticket.close()
    assert admission.num_requests == 0 and admission.num_requests_of_key == {}
    assert all("key-" not in k for k in admission.num_requests_of_key)


def test_zero_means_no_per_key_limit_and_negative_is_refused():
    admission = _admission(per_key=0)
    tickets = [admission.admit(f"10.0.0.{i}", "key-a") for i in range(20)]
    assert admission.num_requests == 20 and admission.num_requests_of_key == {}
    for ticket in tickets:
        ticket.close()
    with pytest.raises(ValueError, match="--max-requests-per-api-key must be >= 0"):
        _admission(per_key=-1)


def test_the_gateway_config_carries_the_flag():
    assert GatewayConfig().max_requests_per_api_key == 0
    admission = Admission.of_gateway(GatewayConfig(max_requests_per_api_key=3))
    assert admission.limits.max_requests_per_api_key == 3
