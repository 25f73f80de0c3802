"""The readers of a JSON body's int, float and bool fields take exactly what vLLM's request models
take: pydantic 2 in lax mode, from the parsed body (vLLM's `OpenAIBaseModel` sets no strict mode).
The table is pydantic's answers, written out (so a change in either shows here), and checked
against the installed pydantic's own."""

from __future__ import annotations

import math

import pytest
from pydantic import TypeAdapter, ValidationError

from epd.gateway.json_fields import NumberRange, boolean_field, lax_value, number_field, number_item
from epd.stages.errors import InvalidRequest


class _Refused:
    def __repr__(self) -> str:  # the same test ids every run (an object's default repr has its address)
        return "NO"


NO = _Refused()
"""vLLM refuses it (a 422 there; the readers' None, a 400 naming the field here)."""
NAN, INF = float("nan"), float("inf")

# value, then what vLLM's `int`, `float` and `bool` make of it
TABLE = [
    # JSON numbers and literals
    (0, 0, 0.0, False),
    (1, 1, 1.0, True),
    (2, 2, 2.0, NO),
    (-1, -1, -1.0, NO),
    (10**30, 10**30, 1e30, NO),
    (10**400, 10**400, NO, NO),  # a float cannot hold it
    (2.0, 2, 2.0, NO),
    (1.0, 1, 1.0, True),
    (0.0, 0, 0.0, False),
    (-0.0, 0, -0.0, False),
    (0.5, NO, 0.5, NO),
    (2.5, NO, 2.5, NO),
    (1e20, NO, 1e20, NO),  # past int64: pydantic's int refuses a float that large
    (NAN, NO, NAN, NO),  # Python's json reads NaN and Infinity
    (INF, NO, INF, NO),
    (True, 1, 1.0, True),
    (False, 0, 0.0, False),
    (None, NO, NO, NO),
    ([1], NO, NO, NO),
    ({"a": 1}, NO, NO, NO),
    # strings of numbers
    ("2", 2, 2.0, NO),
    (" 2 ", 2, 2.0, NO),
    ("+5", 5, 5.0, NO),
    ("-0", 0, -0.0, NO),
    ("007", 7, 7.0, NO),
    ("2.0", 2, 2.0, NO),
    ("1_000", 1000, 1000.0, NO),
    ("0.5", NO, 0.5, NO),
    ("2.", NO, 2.0, NO),
    (".5", NO, 0.5, NO),
    ("1e3", NO, 1000.0, NO),
    ("1e400", NO, INF, NO),
    ("0x10", NO, NO, NO),
    ("1__0", NO, NO, NO),
    ("2 0", NO, NO, NO),
    ("", NO, NO, NO),
    ("\u0662", NO, NO, NO),  # an Arabic-Indic digit: ASCII digits only
    ("9" * 5000, NO, INF, NO),  # pydantic's int refuses more digits than it parses
    # strings of non-finite numbers: a float field's range refuses them (`number_field`)
    ("nan", NO, NAN, NO),
    ("NaN", NO, NAN, NO),
    ("inf", NO, INF, NO),
    ("-inf", NO, -INF, NO),
    ("Infinity", NO, INF, NO),
    # strings of booleans
    ("1", 1, 1.0, True),
    ("0", 0, 0.0, False),
    ("1.0", 1, 1.0, NO),
    ("true", NO, NO, True),
    ("false", NO, NO, False),
    ("True", NO, NO, True),
    ("FALSE", NO, NO, False),
    ("yes", NO, NO, True),
    ("no", NO, NO, False),
    ("on", NO, NO, True),
    ("off", NO, NO, False),
    ("t", NO, NO, True),
    ("f", NO, NO, False),
    ("y", NO, NO, True),
    ("n", NO, NO, False),
    (" true", NO, NO, NO),
    ("maybe", NO, NO, NO),
]
KINDS = (int, float, bool)
CASES = [(value, kind, row[i + 1]) for row in TABLE for i, kind in enumerate(KINDS) for value in row[:1]]


def _same(got, want) -> bool:
    if want is NO:
        return got is None
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if type(got) is not type(want) or got != want:  # the kind too: True == 1 == 1.0 in Python
        return False
    return not isinstance(want, float) or math.copysign(1, got) == math.copysign(1, want)  # -0.0


@pytest.mark.parametrize(("value", "kind", "want"), CASES, ids=lambda v: repr(v)[:24])
def test_each_reader_answers_as_vllms_pydantic_field_does(value, kind, want):
    assert _same(lax_value(value, kind), want), (value, kind, lax_value(value, kind))


@pytest.mark.parametrize(("value", "kind", "want"), CASES, ids=lambda v: repr(v)[:24])
def test_the_table_is_the_installed_pydantics_own_answers(value, kind, want):
    try:
        got = TypeAdapter(kind).validate_python(value, strict=False)
    except ValidationError:
        got = None
    assert _same(got, want), (
        f"pydantic's lax {kind.__name__} makes {got!r} of {value!r}; the table says {want!r}"
    )


def test_a_float_field_reads_strings_and_booleans_and_refuses_what_its_range_does():
    temperature = NumberRange(float, 0.0, math.inf)
    read = [
        number_field({"temperature": v}, "temperature", temperature, None) for v in ("0.5", "1e3", True, 2)
    ]
    assert read == [0.5, 1000.0, 1.0, 2.0] and all(type(v) is float for v in read)
    assert number_field({}, "temperature", temperature, 0.25) == 0.25  # absent or null: the default
    assert number_field({"temperature": None}, "temperature", temperature, 0.25) == 0.25
    for value, shown in (
        ("nan", "'nan'"),
        ("inf", "'inf'"),
        ("-0.5", "'-0.5'"),
        ("warm", "'warm'"),
        ([1], "an array"),
    ):
        with pytest.raises(
            InvalidRequest, match=rf"^'temperature' must be a finite number >= 0, got {shown}$"
        ):
            number_field({"temperature": value}, "temperature", temperature, None)


def test_an_integer_field_reads_as_vllms_int_and_says_its_range():
    top_k = NumberRange(int, -1, 2**31 - 1)
    assert [number_field({"top_k": v}, "top_k", top_k, None) for v in ("2", 2.0, True, " 7 ")] == [2, 2, 1, 7]
    for value in ("1e3", 2.5, "two", -2, 2**31, "nan"):
        with pytest.raises(InvalidRequest, match=r"^'top_k' must be an integer from -1 to 2147483647, got "):
            number_field({"top_k": value}, "top_k", top_k, None)
    with pytest.raises(InvalidRequest, match=r"^'top_k' must be .*, got a huge integer$"):
        number_field({"top_k": 10**40}, "top_k", top_k, None)
    with pytest.raises(
        InvalidRequest, match=r"^'stop_token_ids\[\]' must be an integer from 0 .*, got null$"
    ):
        number_item(None, NumberRange(int, 0, 2**31 - 1), "stop_token_ids[]")


def test_a_boolean_field_reads_as_vllms_bool_and_names_the_field():
    assert [boolean_field({"stream": v}, "stream", False) for v in ("yes", "on", 1, "t", "True")] == [
        True
    ] * 5
    assert [boolean_field({"stream": v}, "stream", True) for v in ("no", "off", 0, 0.0, "f")] == [False] * 5
    assert boolean_field({"stream": None}, "stream", True) is True
    for value, shown in ((2, "2"), ("maybe", "'maybe'"), ("1.0", "'1.0'"), ([], "an array")):
        with pytest.raises(
            InvalidRequest, match=rf"^'stream_options.include_usage' must be true or false, got {shown}$"
        ):
            boolean_field({"include_usage": value}, "include_usage", False, "stream_options.include_usage")
