"""A request's generation options -> `GenerationConfig` (no HTTP in here), each field's type and
range checked where it is read: OpenAI's fields (max_completion_tokens or max_tokens,
temperature, top_p, seed, stop, presence_penalty, frequency_penalty, logit_bias) plus vLLM's
`top_k`, `ignore_eos`, `repetition_penalty`, `min_p`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`,
`spaces_between_special_tokens`, `priority` and structured outputs
(`epd.gateway.structured_request`), with vLLM's meanings. Fields left out take the server's
defaults, which are greedy: unlike OpenAI, a missing `temperature` means 0. Chat and legacy
completions read them alike (`epd.gateway.chat_request.answer_options`, which adds each door's
logprobs: `epd.gateway.logprobs_protocol`)."""

from __future__ import annotations

import math
from typing import Any

from epd.gateway.json_fields import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    TOKEN_ID,
    NumberRange,
    boolean_field,
    check_collection,
    checked_text,
    lax_value,
    number_field,
    number_item,
    shown_value,
)
from epd.gateway.structured_request import parse_structured_outputs
from epd.model_runtime.sampling import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    GenerationConfig,
    check_bad_words,
    check_stop_strings,
)
from epd.stages.errors import InvalidRequest
from epd.stages.scheduling import PRIORITY_MAX, PRIORITY_MIN

GENERATION_OPTIONS = {
    "max_completion_tokens": NumberRange(int, 1, INT32_MAX),
    "max_tokens": NumberRange(int, 1, INT32_MAX),
    "temperature": NumberRange(float, 0.0, math.inf),
    "top_p": NumberRange(float, 0.0, 1.0, low_open=True),
    "top_k": NumberRange(int, -1, INT32_MAX),  # -1 (vLLM's) and 0: off
    "seed": NumberRange(int, INT64_MIN, INT64_MAX),
    "repetition_penalty": NumberRange(float, 0.0, math.inf, low_open=True),
    "presence_penalty": NumberRange(float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "frequency_penalty": NumberRange(float, -MAX_ABS_PENALTY, MAX_ABS_PENALTY),
    "min_p": NumberRange(float, 0.0, 1.0),
    "min_tokens": NumberRange(int, 0, INT32_MAX),
    # vLLM's: lower is served earlier under --scheduling-policy priority; under fcfs only 0 is taken
    # (the pipeline's check against prefill's policy: `Pipeline._check_priority`).
    "priority": NumberRange(int, PRIORITY_MIN, PRIORITY_MAX),
}

_LOGIT_BIAS = NumberRange(float, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)


def parse_generation(body: dict, defaults: GenerationConfig) -> GenerationConfig:
    v = {name: number_field(body, name, spec, None) for name, spec in GENERATION_OPTIONS.items()}
    max_tokens = v["max_completion_tokens"] if v["max_completion_tokens"] is not None else v["max_tokens"]
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = defaults.stop
    elif isinstance(stop, str):
        stops = (checked_text(stop, "stop"),)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(checked_text(s, "stop") for s in stop)
    else:
        raise InvalidRequest("'stop' must be a string or a list of strings")
    try:
        check_stop_strings(stops)
    except ValueError as exc:
        raise InvalidRequest(f"'stop': {exc}") from None

    def given(name: str, default: Any) -> Any:
        return v[name] if v[name] is not None else default

    return GenerationConfig(
        max_new_tokens=max_tokens if max_tokens is not None else defaults.max_new_tokens,
        temperature=given("temperature", defaults.temperature),
        top_p=given("top_p", defaults.top_p),
        top_k=max(0, given("top_k", defaults.top_k)),
        seed=given("seed", defaults.seed),
        stop=stops,
        ignore_eos=boolean_field(body, "ignore_eos", defaults.ignore_eos),
        repetition_penalty=given("repetition_penalty", defaults.repetition_penalty),
        presence_penalty=given("presence_penalty", defaults.presence_penalty),
        frequency_penalty=given("frequency_penalty", defaults.frequency_penalty),
        min_p=given("min_p", defaults.min_p),
        min_tokens=given("min_tokens", defaults.min_tokens),
        logit_bias=_logit_bias(body.get("logit_bias"), defaults.logit_bias),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids"), defaults.stop_token_ids),
        include_stop_str_in_output=boolean_field(
            body, "include_stop_str_in_output", defaults.include_stop_str_in_output
        ),
        allowed_token_ids=_allowed_token_ids(body.get("allowed_token_ids"), defaults.allowed_token_ids),
        bad_words=_bad_words(body.get("bad_words"), defaults.bad_words),
        # the default: fitted to the context after the prompt, as vLLM's
        fit_max_new_tokens=max_tokens is None,
        priority=given("priority", defaults.priority),
        skip_special_tokens=boolean_field(body, "skip_special_tokens", defaults.skip_special_tokens),
        spaces_between_special_tokens=boolean_field(
            body, "spaces_between_special_tokens", defaults.spaces_between_special_tokens
        ),
        n=lax_value(body.get("n"), int) or defaults.n,  # checked by `check_model`
        structured_outputs=parse_structured_outputs(body),
    )


def _logit_bias(value: Any, default: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> (id, bias) pairs, by id."""
    if value is None:
        return default
    check_collection(
        value,
        dict,
        "logit_bias",
        'an object of token ids to biases, such as {"1734": -100}',
        MAX_LOGIT_BIAS_ENTRIES,
    )
    pairs = {}
    for key, bias in value.items():
        token = (
            int(key) if isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 10 else -1
        )
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids ({TOKEN_ID.describe()}), got {shown_value(key)}"
            )
        pairs[token] = number_item(bias, _LOGIT_BIAS, f"logit_bias[{token}]")
    return tuple(sorted(pairs.items()))


def _stop_token_ids(value: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    check_collection(value, list, "stop_token_ids", "a list of token ids", MAX_STOP_TOKEN_IDS)
    return tuple(number_item(v, TOKEN_ID, "stop_token_ids[]") for v in value)


def _allowed_token_ids(value: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    check_collection(value, list, "allowed_token_ids", "a list of token ids", MAX_ALLOWED_TOKEN_IDS)
    if not value:  # vLLM's 400 too: no token could be generated
        raise InvalidRequest(
            "'allowed_token_ids' is empty, which allows no token; leave it out (or null) for all"
        )
    return tuple(number_item(v, TOKEN_ID, "allowed_token_ids[]") for v in value)


def _bad_words(value: Any, default: tuple[str, ...]) -> tuple[str, ...]:
    if value is None:
        return default
    check_collection(value, list, "bad_words", 'a list of strings, such as ["red", "blue"]', MAX_BAD_WORDS)
    if not all(isinstance(w, str) for w in value):
        raise InvalidRequest('\'bad_words\' must be a list of strings, such as ["red", "blue"]')
    words = tuple(checked_text(w, "bad_words") for w in value)
    try:
        check_bad_words(words)
    except ValueError as exc:
        raise InvalidRequest(f"'bad_words': {exc}") from None
    return words
