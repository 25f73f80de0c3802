"""`epd serve`'s command line (epd/cli/parsers/serve.py and the flag groups it adds, epd/cli/flags/):
the flags each role takes, their defaults, and values refused as usage errors."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.parsers.root import build_parser


@pytest.mark.parametrize(
    "argv",
    [["serve", "prefill"], ["serve", "decode"], ["serve"], ["serve", "--colocate"], ["ask", "v.mp4", "q?"]],
)
def test_the_structured_compile_timeout_is_a_flag_of_what_compiles(argv):
    """Prefill, decode, the stack (which passes it to them), the colocated stages and `epd ask`'s
    embedded ones compile structured outputs, and take their deadline."""
    args = build_parser().parse_args([*argv, "--structured-compile-timeout-s", "5"])
    args.model = "/m"
    assert configs.model_config(args).structured_compile_timeout_s == 5.0


def test_the_encoder_has_no_structured_compile_timeout(capsys):
    """The encoder never compiles a grammar: the flag was taken and silently unused."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "encoder", "--structured-compile-timeout-s", "5"])
    assert info.value.code == 2
    assert "unrecognized arguments: --structured-compile-timeout-s 5" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--encoders", "0"], "must be 1 to 64 replicas"),
        (["--decodes", "two"], "expected a number of replicas"),
        (["--health-timeout", "0"], "must be > 0 seconds"),
        (["--health-timeout", "-3"], "must be >= 0 seconds"),
        (["--start-timeout", "0"], "argument --start-timeout: must be > 0 seconds, got '0'"),
        (["--start-timeout", "-1"], "argument --start-timeout: must be >= 0 seconds, got '-1'"),
        (["--start-timeout", "10m"], "argument --start-timeout: expected seconds, got '10m'"),
    ],
)
def test_bad_replica_and_health_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_replica_and_health_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.encoders, args.prefills, args.decodes, args.health_timeout) == (1, 1, 1, 10.0)
    assert args.start_timeout == 600.0  # the start-up and restart timeout it replaces


def test_the_start_timeout_is_the_stacks_start_up_and_restart_timeout():
    """One flag for both: a model slower to load than the start-up allows would also be killed at
    every restart."""
    from epd.cli.launcher import restart_policy

    policy = restart_policy(
        build_parser().parse_args(["serve", "--start-timeout", "1800", "--health-timeout", "5"])
    )
    assert (policy.start_timeout_s, policy.health_timeout_s) == (1800.0, 5.0)


@pytest.mark.parametrize(
    ("flags", "shared", "said"),
    [
        ([], True, "weights: loaded once (bfloat16) by the zygote and shared"),
        (["--no-share-weights"], False, "each model service loads its own copy (--no-share-weights)"),
        (["--device", "cuda"], False, "each model service loads its own copy (--device cuda)"),
        (
            ["--linear-kernel", "onednn"],
            False,
            "each model service loads its own copy (--linear-kernel onednn)",
        ),
    ],
)
def test_the_stack_shares_its_weights_unless_told_or_they_would_be_transformed(flags, shared, said, caplog):
    """--share-weights (the default) has the zygote preload the checkpoint in the stack's dtype; the
    launcher says at INFO which it does, and why not."""
    from epd.cli.launcher import shared_weights
    from epd.model_runtime.shared_weights import SharedWeights

    args = build_parser().parse_args(["serve", "--model", "/m", "--dtype", "bfloat16", *flags])
    with caplog.at_level("INFO", logger="epd.cli.launcher"):
        weights = shared_weights(args)
    assert weights == (SharedWeights("/m", "bfloat16") if shared else None)
    assert said in caplog.text


def test_a_negative_grace_period_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "encoder", "--grace-period", "-1"])
    assert "must be >= 0 seconds" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--max-new-tokens-limit", "4097", "must be 1 to 4096 tokens"),
        ("--max-model-len", "0", "must be at least 1 token, got '0'"),
        ("--max-model-len", "-5", "expected a positive number of tokens"),
        (
            "--max-model-len",
            "1.5K",
            "expected a positive number of tokens",
        ),  # vLLM's: decimals with k, m, g only
        # vLLM's "fit the GPU"
        ("--max-model-len", "-1", "leave --max-model-len out to serve the model's own context"),
        ("--max-model-len", "auto", "leave --max-model-len out to serve the model's own context"),
        ("--max-prompt-tokens", "0", "must be at least 1 token, got '0'"),
        ("--max-prompt-tokens", "-1", "expected a positive number of tokens"),
    ],
)
def test_prefills_request_limits_refuse_values_they_cannot_serve(capsys, flag, value, expected):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "prefill", f"{flag}={value}"])
    assert expected in capsys.readouterr().err


def test_max_model_len_takes_vllms_decimal_suffix_with_a_fraction():
    assert build_parser().parse_args(["serve", "prefill", "--max-model-len", "25.6k"]).max_model_len == 25600


@pytest.mark.parametrize("word, port", [("0", None), ("auto", 0), ("AUTO", 0), ("8000", 8000)])
def test_http_port_0_is_off_and_auto_a_free_port(word, port, tmp_path):
    ports_file = str(tmp_path / "ports.json")
    argv = ["serve", "gateway", "--http-port", word, "--ports-file", ports_file]
    config = configs.gateway_config(build_parser().parse_args(argv))
    assert (config.http.port, config.server.ports_file) == (port, ports_file)


def test_an_http_port_neither_a_number_nor_auto_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "gateway", "--http-port", "any"])
    assert "--http-port" in capsys.readouterr().err
