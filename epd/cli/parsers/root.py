"""`epd`: ask a question about a video, or serve the stack.

    epd ask VIDEO (QUESTION | --messages FILE) [--endpoint HOST:PORT] [--json]
    epd ask VIDEO [QUESTION] --question Q2 ... [--interactive]   # one conversation, in turns
    epd ask --prompt TEXT         # a raw prompt, continued without the chat template (/v1/completions')
    epd serve                     # the whole stack on loopback, one process per service
    epd serve encoder|prefill|decode|gateway
    epd health HOST:PORT          # exit 0 when the service reports SERVING; 1 when it does not, or no answer
    epd bench serve|quality ...  # latency/throughput vs baselines; accuracy on the test split

One module per command (`epd.cli.parsers.ask`, `.serve`; `epd bench` and `epd health` here), built
of the components' flags (`epd.cli.flags`).

Environment variables are read by the command line's definitions alone (`env` in
`epd.cli.flags.arg_types`): EPD_MODEL, EPD_DEVICE, EPD_DTYPE, EPD_NUM_THREADS give the defaults of
--model, --device, --dtype, --num-threads; EPD_API_KEY the default of the gateway's --api-key;
EPD_INTERNAL_SECRET_FILE of --internal-secret-file, and EPD_INTERNAL_SECRET the internal secret
itself when no file is given.
"""

from __future__ import annotations

import argparse

from epd import __version__
from epd.cli.flags.arg_types import positive_seconds
from epd.cli.flags.server import add_tls_client_flags
from epd.cli.parsers.ask import add_ask_command
from epd.cli.parsers.serve import add_serve_command
from epd.cmdline.flexible import add_config_flag
from epd.cmdline.keyword_help import add_keyword_help


class _Parser(argparse.ArgumentParser):
    """argparse, except that a flag it does not know is reported as an unknown flag. Left alone,
    `epd serve --bad-flag x` skips the unknown flag, takes `x` for the role and says "argument
    role: invalid choice: 'x'", which points at the wrong word."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._arg_strings = list(args) if args is not None else None
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        if "invalid choice" in message and getattr(self, "_arg_strings", None):
            unknown = [
                a
                for a in self._arg_strings
                if a.startswith("-") and a != "--" and a.split("=", 1)[0] not in self._option_string_actions
            ]
            if unknown:
                message = f"unknown flag {unknown[0]} (see {self.prog} --help)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="epd", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"epd {__version__}")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text: one line per record ending in request_id=ID when it is about a request; "
        "json: one JSON object per line (ts, level, logger, message, request_id)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    add_ask_command(sub)
    add_serve_command(sub)
    _add_bench_command(sub)
    _add_health_command(sub)
    add_keyword_help(parser)
    for command in _commands(parser):
        add_keyword_help(command)
        if command.prog != "epd bench":  # its suite's parser reads its words (`bench_suite_parser`)
            add_config_flag(command)
    return parser


def bench_suite_parser(suite: str) -> argparse.ArgumentParser:
    """`epd bench SUITE`'s own parser (the suite's module's, which takes vLLM's --config FILE.yaml
    and --help=KEYWORD as every other command does, run as `epd bench` or as a module);
    `parse_command` reads the suite's words with it."""
    if suite == "serve":
        from epd.bench.serve import build_parser as serve_parser

        return serve_parser()
    from epd.bench.quality import build_parser as quality_parser

    return quality_parser()


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser`'s commands, theirs in turn (`epd serve`, `epd serve gateway`, ...)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return [c for s in subparsers for own in s.choices.values() for c in (own, *_commands(own))]


def _add_bench_command(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: serve (latency/throughput), quality (accuracy)")
    bench.add_argument("suite", choices=["serve", "quality"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the suite's own flags (--help)")


def _add_health_command(sub) -> None:
    health = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    health.add_argument("address", help="HOST:PORT")
    health.add_argument("--service", default="", help="service name; default: the whole server")
    health.add_argument(
        "--timeout",
        type=positive_seconds,
        default=3.0,
        metavar="SECONDS",
        help="seconds to wait for the answer",
    )
    add_tls_client_flags(health.add_argument_group("TLS (a service started with --tls-cert)"))
