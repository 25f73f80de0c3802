"""`SharedModelSchedule`: how the colocated server's stages share its model threads, and the
`epd serve --schedule / --decode-max-wait-s / --concurrent-steps` flags that set it."""

from __future__ import annotations

import pytest

from epd.cli.parsers.root import build_parser
from epd.gateway.config import SharedModelSchedule


def test_ttft_first_defers_decode_by_its_wait_and_fifo_defers_nothing():
    assert SharedModelSchedule().deferred_lanes() == {}  # fifo by default
    assert SharedModelSchedule("ttft-first").deferred_lanes() == {"decode": 0.3}
    assert SharedModelSchedule("ttft-first", 0.05).deferred_lanes() == {"decode": 0.05}
    assert SharedModelSchedule("fifo", 0.05).deferred_lanes() == {}


def test_only_ttft_first_puts_first_token_admissions_ahead():
    assert not SharedModelSchedule().first_calls_ahead()
    assert SharedModelSchedule("ttft-first").first_calls_ahead()


@pytest.mark.parametrize(
    "policy,wait_s,steps,match",
    [
        ("lifo", 0.3, 2, "fifo, ttft-first"),
        ("fifo", 0.0, 2, "> 0 s"),
        ("fifo", 0.3, 0, "1 to 3"),
        ("fifo", 0.3, 4, "1 to 3"),
    ],
)
def test_a_bad_schedule_is_refused_naming_what_is_allowed(policy, wait_s, steps, match):
    with pytest.raises(ValueError, match=match):
        SharedModelSchedule(policy, wait_s, steps)


def test_the_serve_flags_default_to_the_config_and_parse():
    parser = build_parser()
    default = parser.parse_args(["serve", "--colocate"])
    assert (default.schedule, default.decode_max_wait_s) == ("fifo", SharedModelSchedule().decode_max_wait_s)
    given = parser.parse_args(["serve", "--colocate", "--schedule", "fifo", "--decode-max-wait-s", "0.5"])
    assert SharedModelSchedule(given.schedule, given.decode_max_wait_s) == SharedModelSchedule("fifo", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--colocate", "--schedule", "random"])


def test_two_steps_at_once_by_default_and_the_flag_sets_it():
    parser = build_parser()
    assert (
        parser.parse_args(["serve", "--colocate"]).concurrent_steps
        == SharedModelSchedule().concurrent_steps
        == 2
    )
    assert parser.parse_args(["serve", "--colocate", "--concurrent-steps", "1"]).concurrent_steps == 1
    for bad in ("0", "4", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--colocate", "--concurrent-steps", bad])


def test_the_colocated_stages_get_the_flag(tmp_path):
    from epd.cli.configs import colocated_stages

    args = build_parser().parse_args(
        ["serve", "--colocate", "--concurrent-steps", "3", "--model", str(tmp_path)]
    )
    assert colocated_stages(args).schedule.concurrent_steps == 3
