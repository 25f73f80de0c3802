"""What `epd ask` prints of each turn: the answer as it streams, stage progress on stderr, the
logprobs tables, the timings line (or with --json one object per turn), and the notes on the model."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

from epd.cli.ask_inputs import asks_in_turns
from epd.cli.ask_timeout import AskTimedOut, within_timeout

if TYPE_CHECKING:
    from epd.cli.ask_tools import AskTools
    from epd.client import AskResult, StreamEvent
    from epd.model_runtime.logprobs import TokenLogprob


async def print_turns(
    args: argparse.Namespace,
    turns: AsyncIterator[tuple[str, AsyncGenerator[StreamEvent, None]]],
    notice: str,
    tools: AskTools | None = None,
    timeout_s: float | None = None,
    timeout_given: bool = True,
) -> None:
    """Run each turn's stream, showing it as it comes, then print its result. With `tools` that
    read the answer for calls, the answer is shown once whole: its content, then its calls.
    `timeout_s`: each turn's deadline (`within_timeout`; None: none), `timeout_given` by --timeout
    (else the SDK's default)."""
    from epd.client import AskResult, StageEvent, TokenDelta

    number = 0
    async for question, stream in turns:
        number += 1
        result = None
        # Once the answer's text has begun (its first token can come before the kv_transfer
        # event), stage lines wait for its end, so they do not cut it in two on a terminal.
        answering = False
        held: list[StageEvent] = []
        items = within_timeout(stream, timeout_s, timeout_given)
        try:
            async with contextlib.aclosing(items):  # a failed turn's call is cancelled now
                async for item in items:
                    if isinstance(item, StageEvent):
                        if answering:
                            held.append(item)
                        else:
                            _progress(item.stage, item.state, item.duration_ms, args.json)
                    elif isinstance(item, TokenDelta):
                        quiet = args.json or (tools is not None and tools.parses)  # its calls read once whole
                        answering = answering or (bool(item.text) and not quiet)
                        _emit_text(item.text, quiet)
                    elif isinstance(item, AskResult):
                        result = item
        except AskTimedOut:
            if answering:  # the answer's line ends before the message on stderr
                print(flush=True)
            raise
        if result is None:
            raise RuntimeError("the stream ended without a result")
        called = tools.answer(result) if tools is not None and tools.parses else None
        if not args.json:
            if called is not None:
                print("\n".join(called.lines()), end="", flush=True)
            print(file=sys.stdout, flush=True)  # the answer's line ends
            if result.logprobs is not None:
                _print_logprobs("the answer's tokens", result.logprobs)
            if result.prompt_logprobs is not None:
                _print_logprobs("the prompt's tokens", result.prompt_logprobs, ranked=True)
        for event in held:
            _progress(event.stage, event.state, event.duration_ms, args.json)
        if args.json:
            extra: dict[str, Any] = {"notice": notice} if notice else {}
            if asks_in_turns(args):
                extra.update(turn=number, question=question)
            if called is not None:
                extra.update(called.to_dict())
            print(json.dumps({**result.to_dict(), **extra}), flush=True)
        else:
            _print_summary(result, called.finish_reason if called is not None else None)


def _progress(stage: str, state: str, duration_ms: float, quiet: bool) -> None:
    if quiet:
        return
    if state == "finished":
        print(f"  [{stage}] done in {duration_ms:.0f} ms", file=sys.stderr, flush=True)
    elif state == "started":
        print(f"  [{stage}] ...", file=sys.stderr, flush=True)


def _emit_text(text: str, quiet: bool) -> None:
    if not quiet and text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _print_logprobs(what: str, logprobs: list[TokenLogprob], ranked: bool = False) -> None:
    """A table on stdout, one row per token: its text (Python's repr, so that spaces, newlines and
    special tokens show), its log-probability (and, `ranked`, its rank), then the most likely
    tokens at its position, each with its own. A prompt's first token has none (NaN): "-"."""
    k = max((len(lp.top) for lp in logprobs), default=0)
    print(f"logprobs of {what} ({len(logprobs)}; top {k} at each position):", flush=True)
    rows = [
        (
            str(i),
            repr(lp.token),
            "-" if math.isnan(lp.logprob) else f"{lp.logprob:.4f}",
            *([str(lp.rank) if lp.rank else "-"] if ranked else []),
            "  ".join(f"{t.token!r} {t.logprob:.4f}" for t in lp.top),
        )
        for i, lp in enumerate(logprobs)
    ]
    header = ("#", "token", "logprob", *(["rank"] if ranked else []), "top" if k else "")
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.rjust(w) if c != 1 else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        print("  " + "  ".join([*cells, row[-1]]).rstrip(), flush=True)


def _print_summary(result: AskResult, finish_reason: str | None = None) -> None:
    """The timings line; `finish_reason`: the tool choice's, in place of the result's."""
    from epd.stages.names import TIMING_NAMES

    timings = ", ".join(f"{name} {getattr(result.timings_ms, f'{name}_ms'):.0f} ms" for name in TIMING_NAMES)
    reused = result.num_reused_prompt_tokens
    reused_text = f", {reused} of them reused from the prefix cache" if reused else ""
    print(
        f"epd: {result.num_frames} frames, {result.num_visual_tokens} visual tokens, "
        f"{result.num_prompt_tokens} prompt tokens{reused_text}, "
        f"{len(result.token_ids)} tokens ({finish_reason or result.finish_reason}); {timings}",
        file=sys.stderr,
        flush=True,
    )


def say_note(text: str, quiet: bool) -> str:
    if text and not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text


def demo_model_notice(meaningless: bool, quiet: bool) -> str:
    if not meaningless:
        return ""
    text = (
        "this is epd's randomly initialised default model: it runs the real pipeline, "
        "but its answers are meaningless"
    )
    if not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text
