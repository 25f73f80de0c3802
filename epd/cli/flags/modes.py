"""Flags that one mode of a command reads and another never does (`epd serve`: the stack or
--colocate; `epd ask`: embedded or --endpoint): each such flag is declared with the mode it serves
(`serves_only`, next to its definition), and a flag the user wrote on the command line in the
other mode is a usage error (`ignored_flags_problem`) rather than taken and silently dropped.

What the user wrote is read from argv, not inferred from values: a default from the environment
(EPD_MODEL, EPD_DEVICE, EPD_API_KEY, ... which a deploy file may export for every mode) is never
refused, and a flag written with its default value is."""

from __future__ import annotations

import argparse
import weakref
from dataclasses import dataclass

from epd.cmdline.flexible import written_flags


@dataclass(frozen=True)
class Mode:
    """One way a command runs, as the user picks it on its command line."""

    command: str
    name: str
    picked: str
    """How the user is in this mode, after "does nothing": "with --endpoint"."""
    leave: str
    """How the user leaves it for the other mode: "drop --endpoint"."""


STACK = Mode("serve", "stack", "in the stack (epd serve without --colocate)", "add --colocate")
COLOCATED = Mode("serve", "colocated", "with --colocate", "drop --colocate")
EMBEDDED = Mode(
    "ask", "embedded", "in embedded mode (epd ask without --endpoint)", "add --endpoint HOST:PORT"
)
ENDPOINT = Mode("ask", "endpoint", "with --endpoint", "drop --endpoint")


def mode_of(args: argparse.Namespace) -> Mode | None:
    """The mode `args` run in; None for a command (or `epd serve ROLE`) whose flags all apply."""
    if args.command == "serve" and args.role is None:
        return COLOCATED if args.colocate else STACK
    if args.command == "ask":
        return ENDPOINT if args.endpoint else EMBEDDED
    return None


@dataclass(frozen=True)
class ServesOnly:
    mode: Mode
    why: str
    """What the flags configure, which the other mode has not: "the embedded model's"."""


_SERVES_ONLY: weakref.WeakKeyDictionary[argparse.Action, ServesOnly] = weakref.WeakKeyDictionary()


def serves_only(mode: Mode, why: str, *actions: argparse.Action) -> None:
    """Declare `actions` (what `add_argument` returned) read in `mode` alone of their command's modes."""
    for action in actions:
        _SERVES_ONLY[action] = ServesOnly(mode, why)


def declared_flags(parser: argparse.ArgumentParser, mode: Mode) -> set[str]:
    """The destinations of `parser`'s flags declared to serve `mode` alone."""
    return {
        a.dest for a in parser._actions if (rule := _SERVES_ONLY.get(a)) is not None and rule.mode == mode
    }


def command_parser(root: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of `root`'s `command` (`epd ask`'s, `epd serve`'s)."""
    subparsers = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def command_tokens(root: argparse.ArgumentParser, argv: list[str], command: str) -> list[str]:
    """The words of `argv` after the command's name (`epd --log-level INFO ask ...` -> `...`)."""
    takes_value = False
    for i, token in enumerate(argv):
        if takes_value:
            takes_value = False
        elif token.startswith("-"):
            action = root._option_string_actions.get(token.partition("=")[0])
            takes_value = action is not None and "=" not in token and action.nargs != 0
        elif token == command:
            return argv[i + 1 :]
    return []


def ignored_flags_problem(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tokens: list[str]
) -> str | None:
    """Why `tokens` (the command's words, parsed by `parser` into `args`) hold flags their mode
    never reads, one sentence per reason naming the flags and what to do instead, or None."""
    mode = mode_of(args)
    if mode is None:
        return None
    ignored: dict[ServesOnly, list[str]] = {}
    for action in written_flags(parser, tokens):
        rule = _SERVES_ONLY.get(action)
        if rule is not None and rule.mode != mode:
            flags = ignored.setdefault(rule, [])
            if action.option_strings[0] not in flags:
                flags.append(action.option_strings[0])
    sentences = []
    for rule, flags in ignored.items():
        one = len(flags) == 1
        sentences.append(
            f"{', '.join(flags)} {'does' if one else 'do'} nothing {mode.picked}: {rule.why}; "
            f"drop {'it' if one else 'them'}, or {mode.leave}"
        )
    return ". ".join(sentences) or None
