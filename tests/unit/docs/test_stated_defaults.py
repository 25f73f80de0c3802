"""The defaults the docs give for `--flag`s are the parsers' defaults (in prose, in the usage block,
in tables with a "default" column), so that a changed default fails here instead of misleading a
user."""

from __future__ import annotations

import re

import pytest

from tests.unit.docs.doc_reading import DEPLOY_DOCS, OTHER_DOCS, USER_DOCS, flag_defaults, read, script_parser

_UNITS = {"": 1, "s": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def stated_value(text: str) -> float | None:
    """The value a doc gives for a default, from the start of `text` ("8192", "120 s", "4 GiB",
    "2^36", "3840x2160", "0 = off"), or None when it is not one (a service name, a sentence)."""
    text = text.strip()
    if m := re.match(r"2\^(\d+)\b", text):
        return float(2 ** int(m.group(1)))
    if m := re.match(r"(\d+)x(\d+)\b", text):
        return float(int(m.group(1)) * int(m.group(2)))
    if m := re.match(r"(\d+(?:\.\d+)?)(?: ?(s|KiB|MiB|GiB))?(?![\w.^x])", text):
        return float(m.group(1)) * _UNITS[m.group(2) or ""]
    return None


def stated_defaults(text: str) -> list[tuple[str, str]]:
    """(flag, what the doc gives as its default) wherever a doc gives one: "`--flag` (8192)",
    "`--flag` seconds (default 30", "`--flag`, default 120 s", the usage block's
    "#   --flag N: ... (default 2", and tables with a "default" column."""
    found = re.findall(r"`(--[a-z0-9-]+)`(?: [a-z]+)?,? \((?:default )?([^;,)]*)", text)
    found += re.findall(r"`(--[a-z0-9-]+)`(?: seconds)?, default ([^;,)]*)", text)
    found += re.findall(
        r"^#\s+(?:--[a-z0-9-]+ )*(--[a-z0-9-]+)[^\n:]*:[^\n]*?\(default:? ([^;,)]*)", text, re.M
    )
    header: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if "default" in cells:
            header = cells
        elif not cells:
            header = []
        elif header and len(cells) == len(header) and not set(line) <= set("|-: "):
            flags = [c for c in cells if c.startswith("`--")]
            if flags and (m := re.match(r"`(--[a-z0-9-]+)`", flags[0])):
                found.append((m.group(1), cells[header.index("default")]))
    return found


@pytest.mark.parametrize("doc", USER_DOCS + DEPLOY_DOCS + OTHER_DOCS)
def test_the_defaults_the_docs_give_are_the_flags_defaults(doc):
    defaults = (
        flag_defaults()
        if doc not in OTHER_DOCS
        else {
            flag: {"train": action.default}
            for action in script_parser("epd.train.train_default_model")._actions
            for flag in action.option_strings
        }
    )
    checked, wrong = 0, []
    for flag, text in stated_defaults(read(doc)):
        value = stated_value(text)
        if value is None or flag not in defaults:
            continue
        checked += 1
        actual = {
            c: d for c, d in defaults[flag].items() if isinstance(d, (int, float)) and not isinstance(d, bool)
        }
        if actual and not any(abs(float(d) - value) <= 1e-9 * max(1.0, value) for d in actual.values()):
            wrong.append(f"{flag}: the doc says {text.strip()!r}, the parsers' defaults are {actual}")
    assert checked, f"{doc}: no stated default found (has the way defaults are written changed?)"
    assert not wrong, f"{doc}:\n" + "\n".join(wrong)


def test_stated_defaults_are_read_as_written():
    """The reader the test above relies on: each form a doc uses, and what is not a default."""
    text = (
        "`--a` (8192) `--b` seconds (default 30; idle) `--c`, default 1 GiB; 0 off `--d` (gateway, "
        "encoder)\n#   --x --e N: calls (default 2)\n| what | flag | default |\n|---|---|---|\n"
        "| x | `--f` (encoder) | 3840x2160 |\n"
    )
    assert sorted(stated_defaults(text)) == [
        ("--a", "8192"),
        ("--b", "30"),
        ("--c", "1 GiB"),
        ("--d", "gateway"),
        ("--e", "2"),
        ("--f", "3840x2160"),
        ("--f", "encoder"),
    ]
    assert [
        stated_value(t) for t in ("8192", "120 s", "4 GiB", "2^36", "0 = off", "0.3 s", "gateway", "2x")
    ] == [8192, 120, 4 << 30, 2**36, 0, 0.3, None, None]
