"""The `epd` command: its command line parsed (`epd.cli.parsers.root`, which lists the commands),
then the command run."""

from __future__ import annotations

import argparse
import sys

from epd.cli.flags.gateway import STRUCTURED_OUTPUTS_CONFIG
from epd.cli.flags.modes import command_parser, command_tokens, ignored_flags_problem
from epd.cli.parsers.root import bench_suite_parser, build_parser
from epd.cli.parsers.serve import flags_before_role
from epd.cli.preload import ensure_preloads, preload_choices
from epd.cmdline.flexible import dashed_flags, vllm_spellings_read
from epd.cmdline.secret_flags import hide_secrets_from_ps


def parse_command(argv: list[str] | None = None) -> argparse.Namespace:
    """`epd`'s command line (`argv`, or the process's own) parsed, or exit 2 saying what to change."""
    parser = build_parser()
    given = _vllm_spellings_read(parser, dashed_flags(list(sys.argv[1:] if argv is None else argv)))
    args = parser.parse_args(given)
    if args.command == "bench":  # the suite's words, read with its parser: its errors and --help
        suite = bench_suite_parser(args.suite)
        args.bench_args = vllm_spellings_read(suite, args.bench_args)
        suite.parse_args(args.bench_args)
    if args.command == "serve" and args.role and (early := flags_before_role(given)):
        parser.error(
            f"{' '.join(early)} before the role {args.role!r} would be ignored: a service's flags come "
            f"after its role (epd serve {args.role} {early[0]} ...)"
        )
    command = command_parser(parser, args.command)
    if problem := ignored_flags_problem(command, args, command_tokens(parser, given, args.command)):
        command.error(problem)  # a flag taken and dropped: the user believed it took effect
    return args


def _vllm_spellings_read(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """`words` with vLLM's spellings read for `parser`'s commands (`epd.cmdline.flexible`, the
    implementation the bench suites run as modules share), the gateway's JSON flag's dotted form
    among them."""
    return vllm_spellings_read(parser, words, json_flags=(STRUCTURED_OUTPUTS_CONFIG,))


def main(argv: list[str] | None = None) -> int:
    args = parse_command(argv)
    if argv is None:  # the process's own command line (not a test's or the zygote's call)
        hide_secrets_from_ps()
    from epd.transport.tracing import configure_logging

    configure_logging(args.log_level, args.log_format)  # the request id in every line about a request
    if argv is None and (preloads := preload_choices(args)) is not None:
        # May run this command again, with tcmalloc and/or MKL's library preloaded.
        if (error := ensure_preloads(*preloads)) is not None:
            print(f"epd {args.command}: {error}", file=sys.stderr)
            return 2
    if args.command == "ask":
        from epd.cli.ask import run_ask

        code = run_ask(args)  # printed, flushed, its pipeline closed
        if argv is None:  # the command's own process (`epd.cli.process_exit`), as `epd serve`'s
            from epd.cli.process_exit import exit_now

            exit_now(code)
        return code
    if args.command == "bench":
        if args.suite == "serve":
            from epd.bench.serve import main as bench_main
        else:
            from epd.bench.quality import main as bench_main
        return bench_main(args.bench_args)
    if args.command == "health":
        from epd.cli.configs import health_security
        from epd.cli.health import check_health
        from epd.transport import security

        try:
            security.configure(health_security(args))
        except ValueError as exc:
            print(f"epd health: {exc}", file=sys.stderr)
            return 2
        return check_health(args.address, args.service, args.timeout)
    from epd.cli.serve import run_serve

    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
