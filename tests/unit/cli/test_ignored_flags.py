"""A flag the user wrote in a mode that never reads it (`epd serve --colocate --routing ...`, `epd ask
--endpoint H:P --device cuda`) is a usage error naming it, not taken and dropped
(`epd.cli.flags.modes`); what the user wrote is read from argv, so environment defaults never are."""

from __future__ import annotations

import argparse

import pytest

from epd.cli import configs
from epd.cli.flags.modes import COLOCATED, STACK, command_parser, declared_flags
from epd.cli.main import parse_command
from epd.cli.parsers.root import build_parser

ASK = ["ask", "--no-video", "what?"]
ENDPOINT = [*ASK, "--endpoint", "127.0.0.1:1"]


def refusal(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_command(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv,flags,says",
    [
        (
            ["serve", "--colocate", "--routing", "round-robin"],
            "--routing does",
            "drop it, or drop --colocate",
        ),
        (
            ["serve", "--colocate", "--load-refresh-interval=2", "--stage-attempt-timeout", "5"],
            "--load-refresh-interval, --stage-attempt-timeout do",
            "drop them, or drop --colocate",
        ),
        (
            ["serve", "--encoder-port", "1", "--colocate", "--decode-port=2"],
            "--encoder-port, --decode-port do",
            "",
        ),
        (["serve", "--colocate", "--encoders", "1"], "--encoders does", "one stage of each"),
        (["serve", "--colocate", "--health-timeout", "3"], "--health-timeout does", ""),
        (["serve", "--colocate", "--start-timeout", "900"], "--start-timeout does", "one stage of each"),
        (["serve", "--colocate", "--tls-ca", "ca.pem"], "--tls-ca does", "--tls-key alone serve"),
        (["serve", "--colocate", "--secret-check-interval-s", "2"], "--secret-check-interval-s does", ""),
        (
            ["serve", "--concurrent-steps", "2"],
            "--concurrent-steps does nothing in the stack",
            "add --colocate",
        ),
        (["serve", "--decode-max-wait-s", "1"], "--decode-max-wait-s does", "add --colocate"),
        (
            [*ENDPOINT, "--device", "cuda", "--dtype=bfloat16", "--model", "m"],
            "--device, --dtype, --model do nothing with --endpoint",
            "drop them, or drop --endpoint",
        ),
        (
            [*ENDPOINT, "--num-threads", "2", "--linear-kernel", "onednn"],
            "--num-threads, --linear-kernel do",
            "",
        ),
        ([*ENDPOINT, "--structured-compile-timeout-s", "5"], "--structured-compile-timeout-s does", ""),
        (
            [*ENDPOINT, "--mkl-dispatch", "features", "--allocator", "system"],
            "--mkl-dispatch, --allocator do nothing with --endpoint: "
            "the libraries preloaded where the model runs",
            "drop them, or drop --endpoint",
        ),
        ([*ENDPOINT, "--allocator=auto"], "--allocator does", "epd serve --allocator"),  # the default
        (
            [*ENDPOINT, "--structured-outputs-config", '{"disable_any_whitespace": true}'],
            "--structured-outputs-config does",
            "a gateway applies its own",
        ),
        (
            [*ENDPOINT, "--structured-outputs-config.disable_any_whitespace", "true"],
            "--structured-outputs-config does",
            "",
        ),
        ([*ENDPOINT, "--close-timeout-s", "5"], "--close-timeout-s does", "close waits for its threads"),
        (
            [*ENDPOINT, "--chat-template", "{{ messages }}"],
            "--chat-template does",
            "its prefill was started with",
        ),
        ([*ENDPOINT, "--device", "cpu"], "--device does", ""),  # written, though the default: refused
        ([*ASK, "--dev", "cuda", "--endpoint", "h:1"], "--device does", ""),  # an abbreviation argparse takes
        ([*ASK, "--tls-ca", "ca.pem"], "--tls-ca does nothing in embedded mode", "add --endpoint HOST:PORT"),
        ([*ASK, "--api-key", "k"], "--api-key does nothing in embedded mode", "calls none"),
        (["--log-level", "INFO", "serve", "--colocate", "--routing", "affinity"], "--routing does", ""),
    ],
)
def test_a_flag_its_mode_never_reads_is_a_usage_error_naming_it(capsys, argv, flags, says):
    error = refusal(capsys, argv)
    assert error.startswith(f"epd {argv[argv.index('serve') if 'serve' in argv else 0]}: error: {flags}")
    assert says in error


def test_each_reason_is_said_once_with_its_flags(capsys):
    error = refusal(
        capsys, ["serve", "--colocate", "--routing", "affinity", "--tls-ca", "c", "--routing", "affinity"]
    )
    assert (
        error.count("--routing") == 1
        and "--routing does nothing" in error
        and "--tls-ca does nothing" in error
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--colocate", "--gateway-port", "1", "--http-port", "2", "--schedule", "ttft-first"],
        ["serve", "--colocate", "--concurrent-steps", "1", "--decode-max-wait-s", "1", "--tls-cert", "c"],
        ["serve", "--routing", "round-robin", "--encoders", "2", "--tls-ca", "c", "--health-timeout", "3"],
        ["serve", "--device", "cpu", "--close-timeout-s", "1"],
        ["serve", "gateway", "--routing", "round-robin", "--tls-ca", "c"],  # a role reads its every flag
        [*ENDPOINT, "--timeout", "5", "--fps", "1", "--api-key", "k", "--tls-ca", "c"],
        [*ASK, "--device", "cpu", "--close-timeout-s", "1", "--chat-template", "t"],
        [*ASK, "--mkl-dispatch", "features", "--allocator", "system"],
        [*ASK, "--structured-outputs-config.disable_any_whitespace", "true"],
        [*ENDPOINT, "--stop=--device"],  # a value that looks like a flag is a value
        [*ENDPOINT, "--seed", "-5"],
        [*ASK[:2], "--endpoint", "h:1", "--", "--device?"],  # after --, the question
    ],
)
def test_flags_their_mode_reads_are_taken(argv):
    parse_command(argv)


@pytest.mark.parametrize(
    "name,value",
    [("EPD_DEVICE", "cuda"), ("EPD_MODEL", "m"), ("EPD_DTYPE", "bfloat16"), ("EPD_NUM_THREADS", "2")],
)
def test_environment_defaults_are_never_refused(monkeypatch, name, value):
    """A deploy file may export EPD_* for every mode: only what the command line says is checked."""
    monkeypatch.setenv(name, value)
    args = parse_command(ENDPOINT)
    assert args.endpoint and "--" not in str(args.model)
    monkeypatch.setenv("EPD_API_KEY", "k")
    assert parse_command(ASK).api_key == "k"  # embedded, the key from the environment: not written


class _Reads(argparse.Namespace):
    """A namespace that records the flags read from it."""

    def __getattribute__(self, name: str):
        if not name.startswith("_"):
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)


def test_the_flags_declared_stack_only_are_those_the_colocated_path_never_reads():
    """Every `epd serve` flag the colocated server's configs (its front door, its stages, its
    process's transport) never read is declared the stack's alone, and none it reads is: a new stack
    flag left undeclared, or a declared one the colocated path starts reading, fails here."""
    parser = build_parser()
    args = parser.parse_args(["serve", "--colocate"])
    reads = _Reads(**vars(args))
    object.__setattr__(reads, "_read", set())
    configs.colocated_gateway_config(reads)
    configs.colocated_stages(reads)
    configs.transport_security(reads)  # `serve._secure_transport`: the process's calls to stages (none)
    read = reads._read - {"tls_ca", "secret_check_interval_s"}  # read into the transport no call uses
    read |= {
        "command",
        "role",
        "colocate",
        "log_level",
        "log_format",
        "allocator",
        "mkl_dispatch",
        "config",  # `parse_command`: replaced by the file's flags before argparse (epd/cmdline/flexible.py)
    }  # `main`, `run_serve`
    serve = command_parser(parser, "serve")
    flags = {a.dest for a in serve._actions if a.option_strings and a.dest != "help"}
    assert flags - read == declared_flags(serve, STACK)
    assert not declared_flags(serve, STACK) & read


def test_the_flags_declared_colocated_only_are_those_the_stack_never_passes():
    from epd.cli.stack_commands import stack_commands

    parser = build_parser()
    serve = command_parser(parser, "serve")
    colocated_only = declared_flags(serve, COLOCATED)
    assert colocated_only == {"decode_max_wait_s", "concurrent_steps"}
    base = stack_commands(parser.parse_args(["serve"]))
    changed = stack_commands(
        parser.parse_args(["serve", "--decode-max-wait-s", "7", "--concurrent-steps", "1"])
    )
    assert changed == base
