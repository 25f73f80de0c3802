"""vLLM's command-line conveniences (its `FlexibleArgumentParser`, vllm/utils/argparse_utils.py),
applied to a command's words before argparse reads them, so a vLLM command line carries over. The
one implementation for `epd`'s commands (`epd.cli.main`) and for the bench suites run as modules
(`python -m epd.bench.serve`, `epd.bench.quality`), which may not import `epd.cli`:

- a long flag's name with underscores is the dashed flag (`--max_model_len 8192`,
  `--max_model_len=8192`): `dashed_flags`, the one place names are normalised;
- `--config FILE.yaml`: a YAML mapping of flag names to values, expanded into the command's
  flags where it stands, a flag the command line writes itself winning over the file's:
  `expanded_config_file`;
- a JSON flag's dotted keys (`--structured-outputs-config.disable_any_whitespace true`) joined into
  the flag's one JSON word: `joined_dotted_flags`;
- `--help=KEYWORD`, a part of the help of the command it follows: `asked_help` (the parts:
  `epd.cmdline.keyword_help`).

`vllm_spellings_read` applies them all (printing a --help=KEYWORD, exiting 2 on a usage error);
`parse_flexibly` is argparse's `parse_args` with them read first.

A command that passes its words on whole to another parser (`epd bench SUITE ...`, the suite's
own) is left them: they are read again with that parser, by the same functions."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection, Sequence

from epd.cmdline.keyword_help import help_keyword, keyword_help

CONFIG_FLAG = "--config"


def dashed_flag(word: str) -> str:
    """`word`, a long flag's name with underscores read as dashes, as vLLM reads it
    (`--max_model_len=8_192` -> `--max-model-len=8_192`): the name alone, up to `=` and to a dotted
    key's `.` (`--structured_outputs_config.disable_any_whitespace`: the key is the JSON's own)."""
    if not word.startswith("--") or word == "--":
        return word
    name, eq, value = word.partition("=")
    flag, dot, key = name.partition(".")
    return flag.replace("_", "-") + dot + key + eq + value


def dashed_flags(words: list[str]) -> list[str]:
    """`words` with every long flag's name dashed (`dashed_flag`); a word that does not start with
    `--` (a value, a short flag) and everything after `--` left as written."""
    if "--" in words:
        end = words.index("--")
        return [dashed_flag(word) for word in words[:end]] + words[end:]
    return [dashed_flag(word) for word in words]


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """`--config FILE.yaml` in the command's --help; `expanded_config_file` replaces it by the file's
    flags before argparse reads the command line."""
    parser.add_argument(
        CONFIG_FLAG,
        metavar="FILE.yaml",
        default=argparse.SUPPRESS,  # never parsed: no attribute
        help="vLLM's: this command's flags from a YAML file, one key per flag (max_model_len: 8192 or "
        "max-model-len: 8192; a list for a repeatable flag, true/false for a switch); a flag also "
        "written on the command line wins over the file's",
    )


class CommandUsageError(ValueError):
    """A usage error in the words read before argparse reads them (a --config its command cannot
    take, vLLM's dotted form of a JSON flag with no value). `command`: the parser of the command
    the word belongs to (`command_at`), whose `error` names it as every other usage error of the
    command does (`epd serve: error: --config FILE: ...`)."""

    def __init__(self, command: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.command = command


def asked_help(root: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, str] | None:
    """The command whose `--help=KEYWORD` `words` (dashed) ask for, under `root`, and the help to
    print (`keyword_help`); None without one, or when it is one of the words a command passes on
    (`epd bench serve --help=KEYWORD`: the suite's parser reads it)."""
    found = help_keyword(words)
    if found is None:
        return None
    i, keyword = found
    parser, start = command_at(root, words, i)
    if _passed_on(parser, words[start:i]):
        return None
    return parser, keyword_help(parser, keyword)


def _passed_on(parser: argparse.ArgumentParser, before: list[str]) -> bool:
    """Whether the word after `before` (the command's own words) is among those `parser` passes on
    whole (`argparse.REMAINDER`, after a positional: `epd bench SUITE ...`)."""
    passes_on = any(a.nargs == argparse.REMAINDER for a in parser._actions)
    return passes_on and any(not word.startswith("-") for word in before)


def expanded_config_file(root: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """`words` (dashed, `dashed_flags`) with `--config FILE` (or `--config=FILE`) replaced by the
    file's flags (`config_file_words`), read for the command it follows (`epd serve`'s, `epd serve
    gateway`'s); a command with no --config of its own (`epd bench`, which passes its suite's words
    on) is left its words.
    CommandUsageError, naming the file: more than one --config, no file, a file epd cannot take."""
    end = words.index("--") if "--" in words else len(words)
    at = [i for i, word in enumerate(words[:end]) if word.partition("=")[0] == CONFIG_FLAG]
    if not at:
        return words
    parser, start = command_at(root, words, at[0])
    if CONFIG_FLAG not in parser._option_string_actions:
        return words
    try:
        return _expanded(parser, words, start, at)
    except ValueError as exc:
        raise CommandUsageError(parser, str(exc)) from None


def _expanded(parser: argparse.ArgumentParser, words: list[str], start: int, at: list[int]) -> list[str]:
    """`expanded_config_file`'s words for `parser`, the command whose own words start at `start`;
    `at`: where --config stands in them."""
    if len(at) > 1:
        raise ValueError(f"{CONFIG_FLAG} is given {len(at)} times: give one file (vLLM takes one too)")
    i = at[0]
    _, eq, path = words[i].partition("=")
    if not eq:
        if i + 1 == len(words) or words[i + 1].startswith("-"):
            raise ValueError(f"{CONFIG_FLAG} needs a file: {CONFIG_FLAG} FILE.yaml")
        path = words[i + 1]
    rest = words[i + (1 if eq else 2) :]
    written = set(written_flags(parser, words[start:i] + rest))
    return words[:i] + config_file_words(parser, path, written) + rest


def config_file_words(
    parser: argparse.ArgumentParser, path: str, written: Collection[argparse.Action] = ()
) -> list[str]:
    """The flags of the YAML file at `path` as `parser`'s command-line words, by vLLM's rules
    (`FlexibleArgumentParser.load_config_file`): `key: value` is `--key=value`; a list is the flag
    once per item (a repeatable flag) or once with every item (a flag of several values), an empty one
    nothing; a mapping is the flag's JSON; `true` is a switch written, `false` its `--no-` form where
    it has one, else nothing (`key: false` is also `--no-key` alone). A flag in `written` (the command line's own) is left out: it wins.
    ValueError naming the file (and the key): not YAML, not a mapping, a key no flag of `parser`'s,
    a value that flag cannot take."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"{CONFIG_FLAG} {path}: a YAML file is named FILE.yaml or FILE.yml (as vLLM's)")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{CONFIG_FLAG} {path}: not YAML: {' '.join(str(exc).split())}") from None
    if config is None:  # an empty file: no flags
        return []
    if not isinstance(config, dict):
        raise ValueError(
            f"{CONFIG_FLAG} {path}: a mapping of flag names to values (max_model_len: 8192), "
            f"not a {type(config).__name__}"
        )
    words: list[str] = []
    for key, value in config.items():
        flag = dashed_flag(f"--{key}")
        action = parser._option_string_actions.get(flag)
        negative = parser._option_string_actions.get(f"--no-{flag[2:]}")
        if action is None and negative is not None and isinstance(value, bool):
            # `parallel_tool_calls: false` is --no-parallel-tool-calls, as vLLM reads it
            flag, action, value = f"--no-{flag[2:]}", negative, not value
        if action is None or flag == CONFIG_FLAG or not isinstance(key, str):
            raise ValueError(
                f"{CONFIG_FLAG} {path}: unknown key {key!r}: {parser.prog} has no {flag} "
                f"(see {parser.prog} --help)"
            )
        if action not in written:
            try:
                words += _flag_words(parser, flag, action, value)
            except ValueError as exc:
                raise ValueError(f"{CONFIG_FLAG} {path}: key {key!r}: {exc}") from None
    return words


def _flag_words(
    parser: argparse.ArgumentParser, flag: str, action: argparse.Action, value: object
) -> list[str]:
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"{flag} is a switch: true or false, not {value!r}")
        negative = "--no-" + flag.removeprefix("--")
        if value:
            return [flag]
        return [negative] if negative in parser._option_string_actions else []
    if value is None or isinstance(value, bool):
        raise ValueError(f"{flag} takes a value, not {json.dumps(value)} (leave the key out for the default)")
    if isinstance(value, list):
        if isinstance(action, argparse._AppendAction):  # repeatable: the flag once per item
            return [f"{flag}={_text(item)}" for item in value]
        if action.nargs in (None, argparse.OPTIONAL):
            raise ValueError(f"{flag} takes one value, not a list")
        return [flag, *map(_text, value)] if value else []
    return [f"{flag}={_text(value)}"]  # one word: a value starting with "-" is not read as a flag


def _text(value: object) -> str:
    """A YAML value as the flag's word: a mapping or list as JSON (a JSON flag), else its text."""
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def command_at(
    root: argparse.ArgumentParser, words: list[str], stop: int
) -> tuple[argparse.ArgumentParser, int]:
    """The (sub)command `words[stop]` belongs to (`epd serve gateway ...`: the gateway role's
    parser), and where its own words start."""
    parser, start, takes_value = root, 0, False
    for i, word in enumerate(words[:stop]):
        if takes_value:
            takes_value = False
        elif word.startswith("-"):
            action = parser._option_string_actions.get(word.partition("=")[0])
            takes_value = action is not None and "=" not in word and action.nargs != 0
        else:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if sub is not None and word in sub.choices:
                parser, start = sub.choices[word], i + 1
    return parser, start


def joined_dotted_flags(root: argparse.ArgumentParser, words: list[str], flag: str) -> list[str]:
    """`words` with vLLM's dotted form of the JSON flag `flag` (`--structured-outputs-config.KEY
    VALUE` or `--structured-outputs-config.KEY=VALUE`, the value JSON or else text, as vLLM's
    `FlexibleArgumentParser` reads it) joined into one `--structured-outputs-config JSON`, at
    the place of the flag's first word, over a JSON object given whole (one that is not JSON is left
    to the flag's check to refuse). CommandUsageError naming the command of `root` (`epd`'s parser)
    the flag belongs to: a dotted key with no value (the last word, or a flag after it)."""
    prefix = flag + "."
    if not any(word.startswith(prefix) for word in words):
        return words
    whole_keys: dict[str, object] = {}
    dotted: dict[str, object] = {}
    out: list[str] = []
    at = None
    rest = iter(words)
    for word in rest:
        if word == "--":
            out += [word, *rest]
            break
        name, eq, value = word.partition("=")
        if name.startswith(prefix) or name == flag:
            if not eq:
                following = next(rest, None)
                # the flag is the last word, or the next is a flag (its value would be taken for one)
                if following is None or following.startswith("--"):
                    raise CommandUsageError(
                        command_at(root, words, words.index(word))[0],
                        f"{name} needs a value (e.g. {prefix}disable_any_whitespace true)",
                    )
                value = following
            if name == flag:
                try:
                    whole = json.loads(value)
                except json.JSONDecodeError:
                    whole = None
                if not isinstance(whole, dict):
                    out += [name, value]  # refused by the flag's own check, with its message
                    continue
                whole_keys.update(whole)
            else:
                try:
                    dotted[name.removeprefix(prefix)] = json.loads(value)
                except json.JSONDecodeError:
                    dotted[name.removeprefix(prefix)] = value
            if at is None:
                at = len(out)
            continue
        out.append(word)
    assert at is not None
    out[at:at] = [flag, json.dumps({**whole_keys, **dotted})]
    return out


def written_flags(parser: argparse.ArgumentParser, tokens: list[str]) -> list[argparse.Action]:
    """The options of `parser` written in `tokens` (the command's words after its name), in order:
    `--flag value`, `--flag=value`, an abbreviation the parser accepts; a flag's value is never read
    as a flag (`--stop --device` stops at "--device"), and nothing after `--` is an option."""
    actions: list[argparse.Action] = []
    takes_value = False
    for token in tokens:
        if takes_value:
            takes_value = False
            continue
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        name, has_value, _ = token.partition("=")
        action = parser._option_string_actions.get(name) or _abbreviated(parser, name)
        if action is None:  # a negative number, or a value argparse takes as one
            continue
        actions.append(action)
        takes_value = not has_value and action.nargs != 0
    return actions


def _abbreviated(parser: argparse.ArgumentParser, prefix: str) -> argparse.Action | None:
    if not parser.allow_abbrev or not prefix.startswith("--"):
        return None
    matches = {a for option, a in parser._option_string_actions.items() if option.startswith(prefix)}
    return matches.pop() if len(matches) == 1 else None  # argparse itself refuses an ambiguous one


def vllm_spellings_read(
    parser: argparse.ArgumentParser, words: list[str], json_flags: Sequence[str] = ()
) -> list[str]:
    """`words` (dashed: `dashed_flags`) with vLLM's spellings read for `parser`'s commands:
    --config FILE.yaml expanded, the dotted form of each of `json_flags` joined into one JSON word;
    --help=KEYWORD printed (exit 0), a usage error exit 2 naming its command."""
    if (asked := asked_help(parser, words)) is not None:
        command, text = asked
        command._print_message(text, sys.stdout)
        command.exit()
    try:
        words = expanded_config_file(parser, words)
        for flag in json_flags:
            words = joined_dotted_flags(parser, words, flag)
        return words
    except CommandUsageError as exc:
        exc.command.error(str(exc))  # `epd serve: error: ...`, as the command's other usage errors


def parse_flexibly(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args(argv)` (the process's own arguments when None) with vLLM's spellings read
    first (`vllm_spellings_read`): what a command run as a module (`python -m epd.bench.serve`)
    parses with, as `epd`'s commands do."""
    words = dashed_flags(list(sys.argv[1:] if argv is None else argv))
    return parser.parse_args(vllm_spellings_read(parser, words))
