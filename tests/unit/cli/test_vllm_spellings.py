"""vLLM's command-line conveniences (`FlexibleArgumentParser`, epd/cmdline/flexible.py) on every
`epd` command: a long flag spelled with underscores, and `--config FILE.yaml` (its keys flag names,
its values the flags' values, a flag written on the command line winning). Each form parses to the
same configs as the dashed flags; a file epd cannot take exits 2 naming the file and the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epd.bench import quality
from epd.bench import serve as bench_serve
from epd.cli import configs
from epd.cli.main import parse_command
from epd.cli.stack_commands import stack_commands
from epd.cmdline.flexible import dashed_flags
from epd.cmdline.secret_flags import hide_secrets
from tests.stack import ROOT, child_env

GATEWAY_DASHED = [
    "--served-model-name=video-qa", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--api-key", "k1", "--api-key", "k2",
    "--structured-outputs-config", '{"disable_any_whitespace": true}',
]  # fmt: skip
GATEWAY_UNDERSCORED = [
    "--served_model_name=video-qa", "--enable_auto_tool_choice", "--tool_call_parser", "qwen3_coder", "--api_key", "k1", "--api-key", "k2",
    "--structured_outputs_config.disable_any_whitespace", "true",
]  # fmt: skip
GATEWAY_CONFIG = """\
served-model-name: video-qa
enable_auto_tool_choice: true
tool_call_parser: qwen3_coder
api_key: [k1, k2]
structured_outputs_config: {disable_any_whitespace: true}
"""
DASHED = [*GATEWAY_DASHED, "--max-model-len", "64", "--max-running-requests", "3"]
UNDERSCORED = [*GATEWAY_UNDERSCORED, "--max_model_len", "64", "--max_running_requests", "3"]
CONFIG = GATEWAY_CONFIG + "max_model_len: 64\nmax_running_requests: 3\ntrust_request_chat_template: false\n"


def test_only_a_long_flags_name_is_dashed():
    assert dashed_flags(
        [
            "serve",
            "--max_model_len",
            "8_192",
            "--served_model_name=a_b",
            "-x_y",
            "--a_b.c_d=e_f",
            "--",
            "--g_h",
        ]
    ) == [
        "serve",
        "--max-model-len",
        "8_192",
        "--served-model-name=a_b",
        "-x_y",
        "--a-b.c_d=e_f",
        "--",
        "--g_h",
    ]


def _stack(flags: list[str]) -> dict[str, list[str]]:
    args = parse_command(["serve", *flags])
    args.model = "/m"
    return stack_commands(args, ports={"encoder": [1], "prefill": [2], "decode": [3]})


@pytest.mark.parametrize("form", ["underscores", "config"])
def test_underscored_flags_and_a_config_file_are_the_dashed_flags(tmp_path, form):
    (path := tmp_path / "serve.yaml").write_text(CONFIG)
    (gateway_path := tmp_path / "gateway.yaml").write_text(GATEWAY_CONFIG)
    flags = UNDERSCORED if form == "underscores" else ["--config", str(path)]
    gateway_flags = GATEWAY_UNDERSCORED if form == "underscores" else ["--config", str(gateway_path)]
    assert _stack(flags) == _stack(DASHED)
    gateway = parse_command(["serve", "gateway", *gateway_flags])
    assert configs.gateway_config(gateway) == configs.gateway_config(
        parse_command(["serve", "gateway", *GATEWAY_DASHED])
    )
    colocated = parse_command(["serve", "--colocate", *flags])
    dashed_colocated = parse_command(["serve", "--colocate", *DASHED])
    assert configs.colocated_gateway_config(colocated) == configs.colocated_gateway_config(dashed_colocated)
    assert configs.colocated_stages(colocated) == configs.colocated_stages(dashed_colocated)
    assert vars(colocated) == vars(dashed_colocated)
    assert (colocated.max_model_len, colocated.max_running_requests, colocated.api_key) == (
        64,
        3,
        ["k1", "k2"],
    )


def test_underscored_flags_of_ask_and_health():
    assert vars(
        parse_command(["ask", "v.mp4", "q", "--max_new_tokens=5", "--stop", "a", "--no_video"])
    ) == vars(parse_command(["ask", "v.mp4", "q", "--max-new-tokens=5", "--stop", "a", "--no-video"]))
    assert parse_command(["health", "h:1", "--tls_ca", "/ca"]).tls_ca == "/ca"


def test_an_unknown_underscored_flag_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_command(["serve", "--max_modl_len", "64"])
    assert exit_.value.code == 2
    assert "epd serve: error: unknown flag --max-modl-len" in capsys.readouterr().err


def test_an_underscored_api_key_is_hidden_from_ps():
    assert hide_secrets(["serve", "--api_key", "k1", "--api_key=k2"]) == [
        "serve",
        "--api_key",
        "***",
        "--api-key=***",
    ]


def test_the_command_line_wins_over_the_file_wherever_it_stands(tmp_path):
    (path := tmp_path / "ask.yaml").write_text(
        "max_new_tokens: 7\nstop: [a, b]\njson: true\nparallel_tool_calls: false\ntemperature: -1\n"
    )
    before = parse_command(
        ["ask", "v.mp4", "q", "--max_new_tokens", "9", "--config", str(path), "--stop", "c"]
    )
    after = parse_command(["ask", "v.mp4", "q", "--config", str(path), "--stop=c", "--max-new-tokens=9"])
    for args in before, after:
        assert (args.max_new_tokens, args.stop, args.json, args.parallel_tool_calls) == (
            9,
            ["c"],
            True,
            False,
        )
    # a list is the repeatable flag once per item; a value starting with "-" stays a value
    alone = parse_command(["ask", "v.mp4", "q", "--config", str(path)])
    assert (alone.max_new_tokens, alone.stop, alone.temperature) == (7, ["a", "b"], -1.0)
    assert "config" not in vars(alone)  # replaced by the file's flags before argparse reads them


def test_false_leaves_a_switch_out_or_writes_its_no_form(tmp_path):
    (path := tmp_path / "serve.yaml").write_text("merge_decoded_groups: false\ncolocate: false\n")
    args = parse_command(["serve", "--config", str(path)])
    assert (args.merge_decoded_groups, args.colocate) == (False, False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_modl_len: 64\n", "unknown key 'max_modl_len': epd serve has no --max-modl-len"),
        ("- max_model_len\n", "a mapping of flag names to values (max_model_len: 8192), not a list"),
        ("max_model_len: [1, 2]\n", "key 'max_model_len': --max-model-len takes one value, not a list"),
        ("max_model_len: null\n", "key 'max_model_len': --max-model-len takes a value, not null"),
        ("colocate: 1\n", "key 'colocate': --colocate is a switch: true or false, not 1"),
        ("max_model_len: [\n", "not YAML"),
        ("config: other.yaml\n", "unknown key 'config'"),
    ],
)
def test_a_file_epd_cannot_take_exits_2_naming_the_file_and_key(tmp_path, capsys, text, expected):
    (path := tmp_path / "serve.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse_command(["serve", "--config", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"epd serve: error: --config {path}: ") and expected in err


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["--config", "/no/such.yaml"], "--config /no/such.yaml: No such file or directory"),
        (["--config=serve.json"], "--config serve.json: a YAML file is named FILE.yaml or FILE.yml"),
        (["--config"], "--config needs a file: --config FILE.yaml"),
        (["--config", "a.yaml", "--config", "b.yaml"], "--config is given 2 times"),
    ],
)
def test_no_file_exits_2(capsys, words, expected):
    with pytest.raises(SystemExit) as exit_:
        parse_command(["serve", *words])
    assert exit_.value.code == 2
    assert f"epd serve: error: {expected}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "prog"),
    [
        (["ask", "v.mp4", "q"], "epd ask"),
        (["serve", "gateway"], "epd serve gateway"),
        (["health", "h:1"], "epd health"),
        (["bench", "serve", "--openai", "http://h:1"], "epd bench serve"),
        (["bench", "quality"], "epd bench quality"),
    ],
)
def test_a_config_error_names_its_command_as_its_other_usage_errors(capsys, command, prog):
    with pytest.raises(SystemExit) as exit_:
        parse_command([*command, "--config", "/no/such.yaml"])
    assert exit_.value.code == 2
    assert f"{prog}: error: --config /no/such.yaml: No such file" in capsys.readouterr().err


BENCH_SERVE_DASHED = [
    "--endpoint=h:1", "--max-new-tokens", "4", "--concurrency=1,4", "--no-baselines", "--videos", "a.mp4", "b.mp4",
]  # fmt: skip
BENCH_SERVE_UNDERSCORED = [
    "--endpoint=h:1", "--max_new_tokens", "4", "--concurrency=1,4", "--no_baselines", "--videos", "a.mp4", "b.mp4",
]  # fmt: skip
BENCH_SERVE_CONFIG = (
    "endpoint: h:1\nmax_new_tokens: 4\nconcurrency: 1,4\nno_baselines: true\nvideos: [a.mp4, b.mp4]\n"
)
BENCH_QUALITY_DASHED = [
    "--max-questions",
    "3",
    "--presets=none",
    "--linear-kernel",
    "onednn",
    "--no-progress",
]
BENCH_QUALITY_CONFIG = "max_questions: 3\npresets: none\nlinear_kernel: onednn\nno_progress: true\n"


@pytest.mark.parametrize("form", ["underscores", "config"])
def test_a_bench_suite_takes_underscores_and_a_config_file_as_vllm_bench_serve(tmp_path, form):
    """`vllm bench serve` is a FlexibleArgumentParser too: the suites' words, which `epd bench` passes
    on, are read with the suite's own parser (`bench_suite_parser`) as every command's are."""
    (serve_yaml := tmp_path / "serve.yaml").write_text(BENCH_SERVE_CONFIG)
    (quality_yaml := tmp_path / "quality.yaml").write_text(BENCH_QUALITY_CONFIG)
    serve_flags = BENCH_SERVE_UNDERSCORED if form == "underscores" else ["--config", str(serve_yaml)]
    quality_flags = (
        [w.replace("-", "_").replace("__", "--") for w in BENCH_QUALITY_DASHED]
        if form == "underscores"
        else ["--config", str(quality_yaml)]
    )
    serve = parse_command(["bench", "serve", *serve_flags]).bench_args
    assert vars(bench_serve.build_parser().parse_args(serve)) == vars(
        bench_serve.build_parser().parse_args(BENCH_SERVE_DASHED)
    )
    assert quality.parse_args(parse_command(["bench", "quality", *quality_flags]).bench_args) == (
        quality.parse_args(BENCH_QUALITY_DASHED)
    )


def _run_module(module: str, *words: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *words], capture_output=True, text=True, env=child_env(), cwd=ROOT,
        timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("form", ["underscores", "config"])
def test_a_bench_suite_run_as_a_module_takes_vllms_spellings_as_epd_bench_does(tmp_path, form):
    """`python -m epd.bench.serve` reads its words with the same functions as `epd bench serve`
    (`epd.cmdline.flexible`): here the words parse, and the suite's own check after parsing
    refuses --with-completions without --openai (nothing is sent)."""
    (path := tmp_path / "serve.yaml").write_text("endpoint: h:1\nwith_completions: true\n")
    words = ["--endpoint", "h:1", "--with_completions"] if form == "underscores" else ["--config", str(path)]
    run = _run_module("epd.bench.serve", *words)
    assert run.returncode == 2, run.stderr
    assert "epd bench serve: --with-completions needs --openai" in run.stderr


def test_a_bench_suite_run_as_a_module_names_its_files_unknown_key(tmp_path):
    (path := tmp_path / "quality.yaml").write_text("num_tests: 3\n")
    run = _run_module("epd.bench.quality", "--config", str(path))
    assert run.returncode == 2
    assert (
        f"epd bench quality: error: --config {path}: unknown key 'num_tests': epd bench quality has no "
        "--num-tests" in run.stderr
    )


@pytest.mark.parametrize("form", ["underscores", "config"])
def test_a_bench_suites_parse_function_reads_vllms_spellings(tmp_path, form):
    """What `python -m epd.bench.quality` parses with (`quality.parse_args`), called alone."""
    (path := tmp_path / "quality.yaml").write_text(BENCH_QUALITY_CONFIG)
    words = (
        [w.replace("-", "_").replace("__", "--") for w in BENCH_QUALITY_DASHED]
        if form == "underscores"
        else ["--config", str(path)]
    )
    assert quality.parse_args(words) == quality.parse_args(BENCH_QUALITY_DASHED)


def test_a_bench_suites_command_line_wins_over_its_file(tmp_path):
    (path := tmp_path / "serve.yaml").write_text(BENCH_SERVE_CONFIG)
    words = parse_command(["bench", "serve", "--max_new_tokens=8", "--config", str(path), "--seed", "3"])
    args = bench_serve.build_parser().parse_args(words.bench_args)
    assert (args.max_new_tokens, args.seed, args.concurrency, args.endpoint) == (8, 3, [1, 4], "h:1")


def test_a_bench_suites_unknown_key_is_named(tmp_path, capsys):
    (path := tmp_path / "quality.yaml").write_text("num_tests: 3\n")
    with pytest.raises(SystemExit) as exit_:
        parse_command(["bench", "quality", "--config", str(path)])
    assert exit_.value.code == 2
    assert (
        f"epd bench quality: error: --config {path}: unknown key 'num_tests': epd bench quality has no "
        "--num-tests" in capsys.readouterr().err
    )
