"""vLLM's `--help=KEYWORD` (`FlexibleArgumentParser.format_help`, vllm/utils/argparse_utils.py) on
every `epd` command: a part of the command's help rather than all of it.

    epd serve --help=request-defaults   # one group of flags, by a name --help=listgroup lists
    epd serve --help=max_model_len      # the flags whose names contain the keyword (--help=tls: a part)
    epd serve --help=listgroup          # the command's groups (older vLLM's; newer vLLM's plain --help)
    epd serve --help=all                # everything, as --help

As vLLM reads it: the keyword without case and with `_` as `-`; a group's name before the flags
that contain it (`--help=model`: the model group, not every flag with "model" in it); no match
says what to try instead, and exits 0 as help does. vLLM's groups are named by their config class
(`ModelConfig`); epd's by titles that explain themselves ("prefill: KV store, prefix cache, ..."),
so a group's name here is its title up to its first ":" or " (", spaces as dashes (`prefill`,
`request-defaults`)."""

from __future__ import annotations

import argparse

HELP_FLAG = "--help"
ALL = "all"
LIST_GROUPS = "listgroup"


def add_keyword_help(parser: argparse.ArgumentParser) -> None:
    """Say in the command's --help that --help=KEYWORD exists (vLLM says it in an epilog)."""
    parser._option_string_actions[HELP_FLAG].help = (
        "show this help message and exit; --help=KEYWORD shows a part (vLLM's): a group of flags "
        f"(--help={LIST_GROUPS} lists them), or the flags whose names contain KEYWORD (--help=tls)"
    )


def help_keyword(words: list[str]) -> tuple[int, str] | None:
    """Where the first `--help=KEYWORD` stands in `words` (none after `--`), and its keyword."""
    for i, word in enumerate(words):
        if word == "--":
            return None
        name, eq, keyword = word.partition("=")
        if name == HELP_FLAG and eq:
            return i, keyword
    return None


def _normal(text: str) -> str:
    return text.strip().lower().replace("_", "-").replace(" ", "-")


def group_name(title: str) -> str:
    """The name --help=NAME shows a group by: "prefill: KV store, ..." -> prefill, "request
    defaults" -> request-defaults, "TLS (--endpoint of ...)" -> tls."""
    return _normal(title.split(":", 1)[0].split(" (", 1)[0])


def _shown(actions: list[argparse.Action]) -> list[argparse.Action]:
    return [a for a in actions if a.help is not argparse.SUPPRESS]


def keyword_help(parser: argparse.ArgumentParser, keyword: str) -> str:
    """`parser`'s help for `--help=keyword`: all of it, its list of groups, one group, or the flags
    whose names contain the keyword; else a line saying nothing matched and what to try."""
    key = _normal(keyword)
    if key == ALL:
        return parser.format_help()
    groups = [g for g in parser._action_groups if g.title and _shown(g._group_actions)]
    if key == LIST_GROUPS:
        names = [group_name(g.title or "") for g in groups]
        width = max(map(len, names), default=0)
        lines = [f"{parser.prog}: groups of flags (--help=GROUP shows one, --help={ALL} all of them)"]
        lines += [f"  {name:<{width}}  {g.title}" for name, g in zip(names, groups, strict=True)]
        return "\n".join(lines) + "\n"
    formatter = parser._get_formatter()
    group = next((g for g in groups if group_name(g.title or "") == key), None)
    if group is not None:
        formatter.start_section(group.title)
        formatter.add_text(group.description)
        formatter.add_arguments(_shown(group._group_actions))
        formatter.end_section()
        return formatter.format_help()
    matched = [a for a in _shown(parser._actions) if any(key in flag.lower() for flag in a.option_strings)]
    if matched:
        formatter.start_section(f"{parser.prog}: flags matching '{key}'")
        formatter.add_arguments(matched)
        formatter.end_section()
        return formatter.format_help()
    return (
        f"{parser.prog}: no group or flags matching '{key}'.\n"
        f"Use '--help={LIST_GROUPS}' to see its groups, or '--help' to see all its flags.\n"
    )
