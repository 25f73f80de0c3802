"""The flags' value types (argparse `type=`): each parses one word and refuses a bad one with an
`ArgumentTypeError` that says what was expected; and `env`, the one reader of the environment
variables that give flags their defaults."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path

MAX_PORT = 65535


def env(name: str, default: str) -> str:
    """A flag's default from the environment variable `name`: the command line reads none elsewhere."""
    return os.environ.get(name, default)


def num_threads(text: str) -> int:
    """--num-threads: a positive count, or "auto" (0)."""
    if text == "auto":
        return 0
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number or auto, got {text!r}")
    return n


def text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


def json_schema_file(path: str) -> str:
    """A JSON Schema file -> its compact JSON text (an object, or ArgumentTypeError)."""
    import json

    try:
        schema = json.loads(text_file(path))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{path} is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{path} must hold a JSON Schema object")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 1734=-100), got {text!r}") from None


def knob(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def count(what: str, high: int, unit: str, low: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` ("expected `what`", "`low` to `high` `unit`")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high} {unit}, got {text!r}")
        return value

    return parse


def max_new_tokens_limit(text: str) -> int:
    """An argparse type: 1 to MAX_NEW_TOKENS tokens (decode reserves KV room for that many at most)."""
    from epd.model_runtime.sampling import MAX_NEW_TOKENS

    return count("a number of tokens", MAX_NEW_TOKENS, "tokens")(text)


def max_logprobs(text: str) -> int:
    """An argparse type: 0 (a request may ask for its tokens' own logprobs, no top tokens) to 2**20
    top tokens a position (more than any vocabulary; a request is held to its model's too)."""
    return count("a number of tokens", 1 << 20, "tokens", low=0)(text)


_TOKENS_WITH_SUFFIX = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def tokens(text: str) -> int:
    """An argparse type: a positive number of tokens, in vLLM's forms too: "32768", "32k" (32,000),
    "25.6k" (25,600), "32K" (32,768; a binary suffix, like no suffix, takes a whole number)."""
    match = _TOKENS_WITH_SUFFIX.fullmatch(text.strip())
    number, suffix = match.groups() if match else ("", "")
    if match is None or ("." in number and suffix not in _DECIMAL_SUFFIXES):
        raise argparse.ArgumentTypeError(
            f"expected a positive number of tokens (32768, 32k or 32K), got {text!r}"
        )
    if suffix in _DECIMAL_SUFFIXES:
        value = int(float(number) * _DECIMAL_SUFFIXES[suffix])
    else:
        value = int(number) * _BINARY_SUFFIXES[suffix]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return value


def max_model_len(text: str) -> int:
    """`tokens`, and vLLM's -1 / auto (fit the GPU's memory) refused saying what to do instead."""
    if text.strip() in ("-1", "auto"):
        raise argparse.ArgumentTypeError(
            f"vLLM's {text.strip()} (the longest that fits the GPU's memory) is not "
            "supported: leave --max-model-len out to serve the model's own context"
        )
    return tokens(text)


# Every port flag (0: the flag's own meaning, off or any free port). Left to the socket, 70001
# would be served as 70001 - 65536, and -5 would fail deep in bind, with a traceback.
port_number = count("a port number", MAX_PORT, "(a TCP port)", low=0)
ANY_FREE_PORT = "auto"
"""--http-port's word for a free port the kernel picks: its 0 already means off (a gRPC port's 0
is the free port: it has no off)."""


def http_port(text: str) -> int | str:
    """--http-port: a port number (0: off) or `auto` (a free port, written to --ports-file)."""
    if text.strip().lower() == ANY_FREE_PORT:
        return ANY_FREE_PORT
    return port_number(text)


def http_api_port(value: int | str) -> int | None:
    """--http-port's value as `HttpApiConfig.port`: None off (0), 0 a free port (`auto`)."""
    if value == ANY_FREE_PORT:
        return 0
    return int(value) or None


def secret_check_interval(text: str) -> float:
    value = positive_seconds(text)
    if value == float("inf"):  # the file would never be looked at again: no rotation
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    return value


def addresses(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


def kv_sources(value: str) -> tuple[str, ...]:
    from epd.decode_svc.kv_sources import parse_allow_list

    entries = addresses(value)
    try:
        parse_allow_list(entries)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return entries
