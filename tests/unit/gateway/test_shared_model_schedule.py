"""`SharedModelSchedule`: how the colocated server's stages share its model thread, and the
`epd serve --schedule / --decode-max-wait-s` flags that set it."""

from __future__ import annotations

import pytest

from epd.cli.main import build_parser
from epd.gateway.config import SharedModelSchedule


def test_ttft_first_defers_decode_by_its_wait_and_fifo_defers_nothing():
    assert SharedModelSchedule().deferred_lanes() == {}  # fifo by default
    assert SharedModelSchedule("ttft-first").deferred_lanes() == {"decode": 0.3}
    assert SharedModelSchedule("ttft-first", 0.05).deferred_lanes() == {"decode": 0.05}
    assert SharedModelSchedule("fifo", 0.05).deferred_lanes() == {}


def test_only_ttft_first_puts_first_token_admissions_ahead():
    assert not SharedModelSchedule().first_calls_ahead()
    assert SharedModelSchedule("ttft-first").first_calls_ahead()


@pytest.mark.parametrize("policy,wait_s,match", [("lifo", 0.3, "fifo, ttft-first"), ("fifo", 0.0, "> 0 s")])
def test_a_bad_schedule_is_refused_naming_what_is_allowed(policy, wait_s, match):
    with pytest.raises(ValueError, match=match):
        SharedModelSchedule(policy, wait_s)


def test_the_serve_flags_default_to_the_config_and_parse():
    parser = build_parser()
    default = parser.parse_args(["serve", "--colocate"])
    assert (default.schedule, default.decode_max_wait_s) == ("fifo", SharedModelSchedule().decode_max_wait_s)
    given = parser.parse_args(["serve", "--colocate", "--schedule", "fifo", "--decode-max-wait-s", "0.5"])
    assert SharedModelSchedule(given.schedule, given.decode_max_wait_s) == SharedModelSchedule("fifo", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--colocate", "--schedule", "random"])
