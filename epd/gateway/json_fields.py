"""Reading one field of a client's JSON body (no HTTP in here): its type and range checked where
it is parsed, so a bad value is a 400 (`InvalidRequest`) that names the field and says what to
send, never a 5xx deeper in, nor a value the wire to the stages cannot carry.

    lax_value     a value read as vLLM reads an `int`, `float` or `bool` field of its requests:
                  pydantic's own lax validation, so what vLLM takes is taken here (2.0 and "2" for
                  an int, "0.5" and 1 for a float, "yes", "off" and 1 for a bool)
    NumberRange   a numeric field's type and range: at most its proto field's, so every
                  accepted value also crosses the wire (TOKEN_ID: any int32 id; the
                  vocabulary's bound is the stages' to check)
    number_field  body[name] within a range; number_item: one entry of a list or object
    boolean_field body[name] as true or false
    checked_text  a string that can be sent on as UTF-8 (no lone surrogates)
    check_collection  an object or list of at most so many entries

An error message shows the client's value cut short (`shown_value`): it must not echo a megabyte.
Chat completions (`epd.gateway.chat_request`), legacy completions, the Responses API and /tokenize
read their bodies with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from pydantic import TypeAdapter, ValidationError

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


_Kind = TypeVar("_Kind", int, float, bool)

_LAX_READERS: dict[type, TypeAdapter[Any]] = {kind: TypeAdapter(kind) for kind in (int, float, bool)}
"""pydantic's validators of vLLM's request field types. vLLM's request models are pydantic models
validated in lax mode (vllm/entrypoints/openai/engine/protocol.py's `OpenAIBaseModel` sets no
strict mode), from the parsed JSON body (python mode): these give exactly their answers."""


def lax_value(value: Any, kind: type[_Kind]) -> _Kind | None:
    """`value` read as vLLM reads a field of type `kind` (int, float or bool), or None where vLLM
    refuses it (a 422 there, a 400 here; null is the caller's: a default or a refusal).
    int: an integer, true / false, a float without a fractional part within int64, a string of
    an integer (" 2 ", "2.0", "1_000"; not "2.5", "1e3" nor "0x10"). float: a number, true /
    false, a string of a number ("0.5", "1e3", "inf", "nan": the fields' ranges refuse the last
    two). bool: true / false, 0 / 1 (0.0 / 1.0 too), "true" / "false", "yes" / "no", "on" /
    "off", "t" / "f", "y" / "n", "1" / "0" (case-insensitive). A client vLLM serves is served."""
    try:
        return cast("_Kind", _LAX_READERS[kind].validate_python(value, strict=False))
    except ValidationError:
        return None


def boolean_field(body: dict, name: str, default: bool, label: str | None = None) -> bool:
    """body[name] as vLLM reads a `bool` (`lax_value`: true, "yes", 1, ...; `default` when absent
    or null); `label` names it in the error (a nested field's path)."""
    value = body.get(name)
    if value is None:
        return default
    flag = lax_value(value, bool)
    if flag is None:
        raise InvalidRequest(f"'{label or name}' must be true or false, got {shown_value(value)}")
    return flag


def number_field(body: dict, name: str, spec: NumberRange, default: Any) -> Any:
    """body[name] as vLLM reads an `int` or `float` of spec.kind (`lax_value`: 2.0 and "2" for
    an int, "0.5" and true for a float) within its range; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    number = lax_value(value, spec.kind)
    ok = number is not None
    if number is not None:
        in_low = number > spec.low if spec.low_open else number >= spec.low
        # isinstance first: math.isfinite of an int past float's range raises OverflowError.
        ok = (isinstance(number, int) or math.isfinite(number)) and in_low and number <= spec.high
    if not ok:
        raise InvalidRequest(f"'{name}' must be {spec.describe()}, got {shown_value(value)}")
    return number


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
