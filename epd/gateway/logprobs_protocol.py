"""OpenAI's `logprobs` in requests and answers, chat and legacy completions (no HTTP in here).

Asked for with chat's `"logprobs": true` (and `top_logprobs`: 0 to the server's --max-logprobs, 20
by default, as vLLM's) or a legacy completion's `"logprobs": k`; both become
`GenerationConfig.logprobs = k` (`epd.model_runtime.logprobs` says what the numbers are: vLLM's
default raw_logprobs, before any sampling setting). A value over --max-logprobs is refused by the
pipeline, which knows the bound (`Pipeline.max_logprobs`).

Answers, one entry per generated token (a streamed chunk carries its own tokens'):
  chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
               "bytes"}, ...]}, ...]}, top_logprobs k entries in vLLM's order: the sampled token
               first, then the most likely others in rank order (vLLM keeps a position's logprobs
               as one dict, sampled token first, and its chat answer takes that dict's first k; so
               a sampled token outside the k most likely displaces the k-th. A greedy answer's are
               the k most likely in rank order, OpenAI's);
  completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, each
               dict the same order untruncated: the sampled token and the k most likely (k + 1
               entries when the sampled one is not among them), as OpenAI's and vLLM's.
A logprob of -inf (a logit the model masked) is sent as -9999.0, vLLM's and OpenAI's floor: JSON
has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from epd.gateway.json_fields import INT32_MAX, NumberRange, boolean_field, number_field
from epd.model_runtime.logprobs import TokenLogprob
from epd.stages.errors import InvalidRequest

LOGPROB_FLOOR = -9999.0
_K = NumberRange(int, 0, INT32_MAX)  # the upper bound is the server's --max-logprobs, checked by the pipeline


def chat_logprobs_option(body: dict) -> int | None:
    """Chat's `logprobs` (true/false) and `top_logprobs` -> k, or None when not asked. As OpenAI
    and vLLM: a top_logprobs above 0 needs `"logprobs": true`."""
    asked = boolean_field(body, "logprobs", False)
    top = number_field(body, "top_logprobs", _K, None)
    if top and not asked:
        raise InvalidRequest(
            f"'top_logprobs' ({top}) needs \"logprobs\": true; set logprobs to true, or leave top_logprobs unset"
        )
    return (top or 0) if asked else None


def prompt_logprobs_option(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: k (0: each prompt token's own logprob alone), or None when not
    asked. Refused with `"stream": true`, as vLLM refuses it (a stream has no place for them)."""
    k = number_field(body, "prompt_logprobs", _K, None)
    if k is not None and stream:
        raise InvalidRequest(
            "'prompt_logprobs' is not available with \"stream\": true; leave prompt_logprobs unset, "
            "or ask without streaming"
        )
    return k


def prompt_logprobs_json(
    prompt_logprobs: Sequence[TokenLogprob] | None,
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` list: None for the first prompt token (nothing comes before it),
    then per token {token_id: {"logprob", "rank", "decoded_token"}}, the prompt token first, then
    the k most likely (ranks 1 to k; k + 1 entries when the prompt token is not among them). None
    when the request did not ask."""
    if prompt_logprobs is None:
        return None
    out: list[dict[str, Any] | None] = []
    for lp in prompt_logprobs:
        if math.isnan(lp.logprob):  # the first token
            out.append(None)
            continue
        entry = {
            str(lp.token_id): {"logprob": _floored(lp.logprob), "rank": lp.rank, "decoded_token": lp.token}
        }
        for rank, t in enumerate(lp.top, start=1):
            entry.setdefault(
                str(t.token_id), {"logprob": _floored(t.logprob), "rank": rank, "decoded_token": t.token}
            )
        out.append(entry)
    return out


def completion_logprobs_option(body: dict) -> int | None:
    """A legacy completion's `logprobs`: k (0: the sampled token's alone), or None when not asked."""
    return number_field(body, "logprobs", _K, None)


def _floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _token_bytes(token: str) -> list[int]:
    """OpenAI's `bytes`: the token text's UTF-8 (vLLM's: a lone piece of a character is U+FFFD's)."""
    return list(token.encode("utf-8", errors="replace"))


def _sampled_first(lp: TokenLogprob) -> list[tuple[str, float]]:
    """A position's (token, logprob) pairs in vLLM's order: the sampled token, then the k most
    likely without it (its dict of token id -> logprob, filled in that order)."""
    return [(lp.token, lp.logprob), *((t.token, t.logprob) for t in lp.top if t.token_id != lp.token_id)]


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object for these tokens."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": _floored(lp.logprob),
                "bytes": _token_bytes(lp.token),
                "top_logprobs": [
                    {"token": token, "logprob": _floored(logprob), "bytes": _token_bytes(token)}
                    for token, logprob in _sampled_first(lp)[: len(lp.top)]
                ],
            }
            for lp in logprobs
        ]
    }


def completion_logprobs(logprobs: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """A legacy completion choice's (or chunk's) `logprobs` object for these tokens; `text_offset`:
    the first token's place in the choice's text (after an echoed prompt, or after the tokens of
    earlier chunks). Each next offset adds the token text's length, as vLLM's. With `echo`, the
    prompt's tokens (`AskSummary.prompt_logprobs`) come first, the first with null values."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        # An echoed prompt's first token has none (NaN: `prompt_token_logprobs`): null, as vLLM's.
        "token_logprobs": [None if math.isnan(lp.logprob) else _floored(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            None
            if math.isnan(lp.logprob)
            else {token: _floored(logprob) for token, logprob in _sampled_first(lp)}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }
