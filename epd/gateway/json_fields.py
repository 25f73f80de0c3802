"""Reading one field of a client's JSON body (no HTTP in here): its type and range checked where
it is parsed, so a bad value is a 400 (`InvalidRequest`) that names the field and says what to
send, never a 5xx deeper in, nor a value the wire to the stages cannot carry.

    NumberRange   a numeric field's type and range: at most its proto field's, so every
                  accepted value also crosses the wire (TOKEN_ID: any int32 id; the
                  vocabulary's bound is the stages' to check)
    number_field  body[name] within a range; number_item: one entry of a list or object. An
                  integer field takes what vLLM's does (`lax_int`)
    boolean_field body[name] as true or false (never 0 or 1)
    checked_text  a string that can be sent on as UTF-8 (no lone surrogates)
    check_collection  an object or list of at most so many entries

An error message shows the client's value cut short (`shown_value`): it must not echo a megabyte.
Chat completions (`epd.gateway.chat_request`), legacy completions and /tokenize read their
bodies with these.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from epd.stages.errors import InvalidRequest

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class NumberRange:
    """A numeric request field: its type and the range it must lie in (the proto field's range
    at most, so every accepted value also crosses the wire to the stages)."""

    kind: type  # int or float
    low: float
    high: float
    low_open: bool = False  # low itself excluded (fps > 0)

    def describe(self) -> str:
        if self.kind is int:
            return f"an integer from {int(self.low)} to {int(self.high)}"
        low = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        return f"a finite number {low}" + (f" and <= {self.high:g}" if self.high != math.inf else "")


TOKEN_ID = NumberRange(int, 0, INT32_MAX)
"""A token id as the wire carries it; the vocabulary's bound is checked by the stages that load it."""


def checked_text(value: Any, name: str) -> str:
    """A JSON string ("" for null) that can be sent on as UTF-8: JSON's \\ud800-style escapes can
    spell lone surrogates, which no UTF-8 encoder (protobuf's included) accepts."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"'{name}' is not valid Unicode text (it holds a lone surrogate escape)"
        ) from None
    return value


def boolean_field(body: dict, name: str, default: bool, label: str | None = None) -> bool:
    """body[name] as true or false (`default` when absent or null); `label` names it in the error
    (a nested field's path)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{label or name}' must be true or false, got {shown_value(value)}")
    return value


_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?", re.ASCII)
"""A string pydantic reads as an integer: digits (single underscores between them), a sign, a
zero fractional part."""


def lax_int(value: Any) -> int | None:
    """`value` read as vLLM reads an `int` field of its requests (a pydantic model, validated in
    pydantic's lax mode: vllm/entrypoints/openai/engine/protocol.py's `OpenAIBaseModel` sets no
    strict mode), or None when vLLM refuses it: an integer; true and false (1 and 0); a finite
    number without a fractional part (2.0); a string of an integer, as pydantic parses it ("16",
    " 2.0 ", "1_000"; not "2.5", "1e3" nor "0x10"). A client that vLLM serves is served here."""
    if isinstance(value, int):  # bool too: pydantic's lax int takes true as 1
        return int(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and _INT_TEXT.fullmatch(text := value.strip()):
        try:
            return int(text.partition(".")[0])
        except ValueError:  # more digits than Python parses from a string (pydantic's bound is lower)
            return None
    return None


def number_field(body: dict, name: str, spec: NumberRange, default: Any) -> Any:
    """body[name] as spec.kind within its range (an integer as vLLM reads one, `lax_int`; a float
    from a number, never a bool); `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if spec.kind is int:
        number = lax_int(value)
        ok = number is not None
        value = value if number is None else number
    elif ok:
        try:
            value = float(value)  # an integer of 400 digits overflows: not a usable number
        except OverflowError:
            ok = False
    if ok:
        in_low = value > spec.low if spec.low_open else value >= spec.low
        # isinstance first: math.isfinite of an int past float's range raises OverflowError.
        ok = (isinstance(value, int) or math.isfinite(value)) and in_low and value <= spec.high
    if not ok:
        raise InvalidRequest(f"'{name}' must be {spec.describe()}, got {shown_value(value)}")
    return value


def number_item(value: Any, spec: NumberRange, label: str) -> Any:
    """One number of an object or list field (null is no default there)."""
    if value is None:
        raise InvalidRequest(f"'{label}' must be {spec.describe()}, got null")
    return number_field({label: value}, label, spec, None)


def check_collection(
    value: Any, kind: type[dict] | type[list], name: str, what: str, max_entries: int
) -> None:
    """`value` is a `kind` (an error that says it must be `what`) of at most `max_entries` entries."""
    if not isinstance(value, kind):
        raise InvalidRequest(f"'{name}' must be {what}")
    if len(value) > max_entries:
        raise InvalidRequest(f"'{name}' has {len(value)} entries; at most {max_entries} are accepted")


def shown_value(value: Any) -> str:
    """A client's value for an error message, cut short: the message must not echo a megabyte
    (nor recurse through a deeply nested array)."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "an array"
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 64 else text[:61] + "..."
