"""`epd ask VIDEO QUESTION` (or `--messages FILE`, a conversation): embedded (one process, no
ports) or against --endpoint. Both send the same messages (`epd.stages.messages`): QUESTION is one
user message [media, QUESTION]; FILE holds the processor's chat form, parts in your order.

Both modes print the SDK's typed result (`epd.client.AskResult`): the answer as it streams, stage
progress on stderr, then a timings line; with --json one object, `AskResult.to_dict()` (the
field names of the HTTP API's `epd` object), plus `notice` for the demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epd.client import AskResult
    from epd.client import StageEvent as ClientStageEvent
    from epd.gateway.pipeline import AskSummary
    from epd.stages.messages import Message


def run_ask(args: argparse.Namespace) -> int:
    from epd.client import EpdError
    from epd.stages.errors import InvalidRequest

    path = Path(args.video)
    if not path.is_file():
        print(f"epd: no such file: {path}", file=sys.stderr)
        return 2
    try:
        messages = _messages(args)
    except (InvalidRequest, OSError, ValueError) as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 2
    notice: list[str] = []
    try:
        result = asyncio.run(
            _ask_remote(args, path, messages) if args.endpoint else _ask_embedded(args, path, messages, notice)
        )
    except EpdError as exc:  # the server's status and message
        print(f"epd: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one message per failure for a CLI user
        # Embedded mode ran the servers' code in this process: name its error as they would.
        from epd.transport.errors import status_of

        code, message = status_of(exc)
        print(f"epd: {code.name}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**result.to_dict(), **({"notice": notice[0]} if notice else {})}))
    else:
        _print_summary(result)
    return 0


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


def _print_summary(result: AskResult) -> None:
    from epd.stages.names import TIMING_NAMES

    print(file=sys.stdout)
    timings = ", ".join(f"{name} {getattr(result.timings_ms, f'{name}_ms'):.0f} ms" for name in TIMING_NAMES)
    print(f"epd: {result.num_frames} frames, {result.num_visual_tokens} visual tokens, "
          f"{len(result.token_ids)} tokens ({result.finish_reason}); {timings}", file=sys.stderr)


def _messages(args: argparse.Namespace) -> list[Message]:
    """The conversation: QUESTION as [media, QUESTION], or --messages FILE (- for stdin)."""
    from epd.stages.messages import check_messages, from_chat_template, question_messages

    if (args.question is None) == (not args.messages):
        raise ValueError("give a QUESTION or --messages FILE (one of them)")
    if not args.messages:
        return question_messages(args.question)
    source = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text(encoding="utf-8")
    messages = from_chat_template(json.loads(source))
    check_messages(messages)
    return messages


async def _ask_embedded(
    args: argparse.Namespace, path: Path, messages: list[Message], notice: list[str]
) -> AskResult:
    from epd.cli import configs
    from epd.client import StageEvent as ClientStageEvent
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.gateway.pipeline import AskRequest, AskSummary
    from epd.model_runtime.default_model import accuracy_notice, is_meaningless
    from epd.model_runtime.loader import resolve_model_path
    from epd.stages.contracts import MediaInput, StageEvent
    from epd.stages.names import Stage

    model = configs.model_config(args)
    model_path = resolve_model_path(model.model)
    text = _notice(is_meaningless(model_path), args.json) or _say(accuracy_notice(model_path), args.json)
    notice += [text] if text else []
    if not args.json:
        print(f"epd: loading {model_path} (embedded mode)", file=sys.stderr, flush=True)
    pipeline = build_embedded_pipeline(model)
    request = AskRequest(
        messages=messages,
        media=MediaInput(path.read_bytes()),
        sampling=configs.sampling_options(args),
        generation=configs.generation_config(args),
        pruning=configs.pruning_config(args),
    )
    started = time.perf_counter()
    events: list[ClientStageEvent] = []
    summary = None
    async for item in pipeline.ask(request):
        if isinstance(item, StageEvent):
            at_ms = (time.perf_counter() - started) * 1e3
            events.append(ClientStageEvent(Stage.of(item.stage), item.state, at_ms, item.duration_ms, item.details))
            _progress(item.stage, item.state, item.duration_ms, args.json)
        elif isinstance(item, AskSummary):
            summary = item
        else:
            _emit_text(item.text, args.json)
    assert summary is not None
    return _result_of(summary, events)


def _result_of(summary: AskSummary, events: list[ClientStageEvent]) -> AskResult:
    """The pipeline's own summary as the SDK's result, so that both modes print the same thing:
    through the gateway's converter and the SDK's, the path a remote answer takes."""
    from epd.client.types import result_from_proto
    from epd.gateway.servicer import summary_to_proto

    return result_from_proto(summary_to_proto(summary), events)


async def _ask_remote(args: argparse.Namespace, path: Path, messages: list[Message]) -> AskResult:
    from epd.client import AskResult, AsyncEpdClient, StageEvent, TokenDelta

    # Zero and empty mean "the server's default"; the server checks and parses every option.
    options: dict = dict(
        fps=args.fps, max_frames=args.max_frames, num_frames=args.num_frames, max_pixels=args.max_pixels,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=list(args.stop), pruning=args.pruning, pruning_knobs=dict(args.pruning_knob),
    )  # fmt: skip
    async with AsyncEpdClient(args.endpoint, api_key=args.api_key) as client:
        async for item in client.stream(path, messages=messages, **options):
            if isinstance(item, StageEvent):
                _progress(item.stage, item.state, item.duration_ms, args.json)
            elif isinstance(item, TokenDelta):
                _emit_text(item.text, args.json)
            elif isinstance(item, AskResult):
                return item
    raise RuntimeError("unreachable: the SDK's stream ends with an AskResult or raises EpdError")


def _say(text: str, quiet: bool) -> str:
    if text and not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text


def _notice(meaningless: bool, quiet: bool) -> str:
    if not meaningless:
        return ""
    text = ("this is epd's randomly initialised default model: it runs the real pipeline, "
            "but its answers are meaningless")
    if not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text
