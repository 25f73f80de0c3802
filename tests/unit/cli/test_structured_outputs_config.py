"""vLLM's `--structured-outputs-config` on every `epd serve` form whose front door reads requests
(the gateway role, the stack's gateway, --colocate): its JSON and its dotted form
(`--structured-outputs-config.disable_any_whitespace true`, vLLM's `FlexibleArgumentParser`), the
keys epd acts on, the no-op ones it takes, and exit 2 naming what it does not; and what the
front door does with it (`StructuredOutputsConfig.applied`). Through the real stack:
tests/integration/test_structured_outputs_config.py."""

from __future__ import annotations

import pytest

from epd.cli import configs
from epd.cli.main import parse_command
from epd.cli.stack_commands import stack_commands
from epd.gateway.config import StructuredOutputsConfig
from epd.model_runtime.sampling import GenerationConfig, StructuredOutputs
from tests.unit.cli.stack_args import _parsed

ON = StructuredOutputsConfig(disable_any_whitespace=True)


@pytest.mark.parametrize("flags", [
    ["--structured-outputs-config", '{"disable_any_whitespace": true}'],
    ['--structured-outputs-config={"backend": "xgrammar", "disable_any_whitespace": "yes"}'],
    ["--structured-outputs-config.disable_any_whitespace", "true"],
    ["--structured-outputs-config.disable_any_whitespace=1", "--structured-outputs-config.backend", "xgrammar"],
    # dotted keys over the whole object, wherever they stand
    ["--structured-outputs-config.disable_any_whitespace", "true", "--structured-outputs-config",
     '{"disable_any_whitespace": false, "disable_fallback": true}'],
])  # fmt: skip
def test_the_json_and_the_dotted_form_reach_every_front_door(flags):
    assert configs.gateway_config(parse_command(["serve", "gateway", *flags])).structured_outputs == ON
    stack = parse_command(["serve", *flags])
    stack.model = "/m"
    gateway = stack_commands(stack)["gateway"]
    assert configs.gateway_config(_parsed(gateway)).structured_outputs == ON
    assert all(
        "--structured-outputs-config" not in c for n, c in stack_commands(stack).items() if n != "gateway"
    )
    colocated = parse_command(["serve", "--colocate", *flags])
    assert configs.colocated_gateway_config(colocated).structured_outputs == ON


@pytest.mark.parametrize("value", [
    '{}', '{"disable_any_whitespace": false}', '{"backend": "auto", "disable_fallback": true}',
    '{"reasoning_parser": "", "enable_in_reasoning": "no", "disable_additional_properties": false}',
])  # fmt: skip
def test_keys_that_ask_for_nothing_here_are_taken(value):
    args = parse_command(["serve", "gateway", "--structured-outputs-config", value])
    assert configs.gateway_config(args).structured_outputs == StructuredOutputsConfig()
    assert (
        configs.gateway_config(parse_command(["serve", "gateway"])).structured_outputs
        == StructuredOutputsConfig()
    )


@pytest.mark.parametrize(("flags", "expected"), [
    (["--structured-outputs-config", '{"disable_any_whitespace": tru'], "is not JSON (Expecting value at character 27)"),
    (["--structured-outputs-config", "[1]"], "must be a JSON object"),
    (["--structured-outputs-config", '{"foo": 1, "bar": 2}'], "unknown keys 'foo', 'bar': this server acts on disable_any_whitespace"),
    (["--structured-outputs-config.whitespace", "true"], "unknown key 'whitespace'"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "backend 'guidance' (this server's is xgrammar"),
    (["--structured-outputs-config", '{"reasoning_parser": "qwen3", "enable_in_reasoning": true}'],
     "not supported by this server: enable_in_reasoning (a constraint starts after the reasoning here"),
    (["--structured-outputs-config.disable_additional_properties", "true"], "disable_additional_properties (the guidance"),
    (["--structured-outputs-config.disable_any_whitespace", "maybe"], 'disable_any_whitespace must be true or false, got "maybe"'),
    (["--structured-outputs-config.disable_any_whitespace"], "--structured-outputs-config.disable_any_whitespace needs a value"),
    # a flag after it is not its value (it took `--max-model-len` and left `64` a stray word)
    (["--structured-outputs-config.disable_any_whitespace", "--max-model-len", "64"],
     "--structured-outputs-config.disable_any_whitespace needs a value"),
])  # fmt: skip
@pytest.mark.parametrize("form", [["serve", "gateway"], ["serve"], ["serve", "--colocate"]])
def test_what_it_does_not_take_is_exit_2_naming_it(capsys, form, flags, expected):
    with pytest.raises(SystemExit) as info:
        parse_command([*form, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse's usage, then one line saying what to change
    command = " ".join(word for word in ["epd", *form] if not word.startswith("-"))
    assert last.startswith(f"{command}: error: ") and expected in last, err  # as its other usage errors


def test_the_front_door_holds_every_spec_to_it_a_requests_own_false_too():
    """vLLM's xgrammar backend reads the server's disable_any_whitespace alone: a request's false
    does not turn it off (a request's true still holds without the flag: epd's own)."""
    schema = StructuredOutputs(json_schema='{"type": "object"}')
    for spec in (schema, StructuredOutputs(json_object=True), StructuredOutputs(regex="a")):
        assert ON.applied(GenerationConfig(structured_outputs=spec)).structured_outputs == StructuredOutputs(
            **{**spec.__dict__, "disable_any_whitespace": True}
        )
    assert ON.applied(GenerationConfig()) == GenerationConfig()
    asked = GenerationConfig(
        structured_outputs=StructuredOutputs(json_object=True, disable_any_whitespace=True)
    )
    assert StructuredOutputsConfig().applied(asked) == asked
