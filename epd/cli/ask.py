"""`epd ask VIDEO QUESTION` (or `--messages FILE`, a conversation): embedded (one process, no
ports) or against --endpoint. Both send the same messages (`epd.stages.messages`): QUESTION is one
user message [media, QUESTION]; FILE holds the processor's chat form, parts in your order.

`epd ask --no-video QUESTION` (or `--no-video --messages FILE` without a media part) is a
text-only conversation: no media is read or sent, no encoder runs.

`epd ask --prompt TEXT` continues a raw prompt, as the HTTP API's /v1/completions and the SDK's
`prompt=` do: no chat template (TEXT tokenised as the model's `tokenizer(TEXT)`), no media, so
the answer is `model.generate(tokenizer(TEXT).input_ids, do_sample=False)`'s. It takes no VIDEO,
QUESTION, --messages or turns.

`epd ask --messages FILE --continue-final-message` (FILE ending with the assistant's message)
continues that message, as vLLM's `continue_final_message` (with `add_generation_prompt` false,
which the flag implies: continuing cannot follow a new answer's opening); the answer is the
continuation alone. `--no-add-generation-prompt` alone renders the conversation without the
opening of a new answer. Both shape a --messages conversation's template only.
`--chat-template-kwargs JSON` passes extra variables to the model's chat template in any chat form
(vLLM's `chat_template_kwargs`: `'{"enable_thinking": false}'` closes a Qwen3.5 template's
thinking block); --prompt has no template to take them.

Follow-ups: `--question Q` (repeatable, after QUESTION if given) and `--interactive` (questions
read from stdin, one a line, until EOF or an empty line) ask in turn as one conversation: each
turn sends the earlier questions and answers too (`epd.client.conversation.History`, the SDK's
`client.conversation`). Embedded mode keeps its one pipeline across turns, so the servers' caches
(the encoder's, prefill's prefix cache) serve the follow-ups as they would behind a gateway.

`--tools FILE` (a JSON list of OpenAI function tools) renders them into the prompt and reads the
answer's calls as the chat API does (`epd.cli.ask_tools`: --tool-choice, --tool-call-parser); the
answer is then shown once whole, its content and a line per call (--json: `content`, `tool_calls`).

Both modes print the SDK's typed result (`epd.client.AskResult`): the answer as it streams, stage
progress on stderr, with --logprobs K / --prompt-logprobs K a table per token after the answer (its
logprob and the K most likely tokens'), then a timings line; with --json one object per turn and line,
`AskResult.to_dict()` (the field names of the HTTP API's `epd` object), plus `notice` for the
demo model and, in a conversation, `turn` (from 1) and `question`.

`--timeout SECONDS` is the client's deadline of each question (each turn), as the OpenAI client's
`timeout`: embedded, the pipeline's stages get it as the request's client deadline
(`epd.stages.deadline`) and the question is cancelled when it passes; against --endpoint, it is
the SDK's `timeout_s`, the gRPC call's deadline, which the gateway passes on to every stage. When
it passes: one line saying what to raise, exit status EXIT_TIMEOUT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

EXIT_TIMEOUT = 124
"""`epd ask`'s exit status when a question's --timeout passed before its answer ended (GNU
timeout's). The others: 0 answered, 1 a server's error, 2 a bad flag or input, 3 a model that cannot
be loaded (embedded), 130 Ctrl-C, 141 (128 + SIGPIPE) the answer's reader closed the pipe."""

if TYPE_CHECKING:
    from epd.cli.ask_tools import AskTools
    from epd.client import AskResult, StreamEvent
    from epd.client import StageEvent as ClientStageEvent
    from epd.gateway.ask_types import AskSummary
    from epd.gateway.embedded import EmbeddedPipeline
    from epd.gateway.pipeline import Pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.logprobs import TokenLogprob
    from epd.prefill_svc.config import PrefillConfig
    from epd.stages.messages import ChatTemplateOptions, Message
    from epd.stages.raw_prompt import RawPrompt


def run_ask(args: argparse.Namespace) -> int:
    from epd.cli import configs
    from epd.cli.ask_tools import ask_tools
    from epd.stages.errors import InvalidRequest

    try:
        template = _template(args)
        prompt = _raw_prompt(args)
        path = None if prompt is not None else _media_path(args)
        messages = None if prompt is not None else _messages(args, template)
        tools = ask_tools(args)
        _check_tls_flags(args)
        if args.fps is not None and args.num_frames:  # what every door refuses (ONE_FRAME_CHOICE)
            raise ValueError(
                "--fps and --num-frames: give one (--num-frames N: exactly N frames; "
                "--fps F: F frames per second, at most --max-frames)"
            )
        # Embedded mode's model config now: a bad --device or --dtype is the user's to fix (exit 2),
        # not a server error out of the event loop (INTERNAL, exit 1).
        model = None if args.endpoint else configs.model_config(args)
        _check_generation(args, embedded=model is not None)
        if args.prompt is not None and args.chat_template is not None:  # as --chat-template-kwargs
            raise ValueError("--chat-template renders a chat's prompt; --prompt has no template: drop one")
        prefill = None if model is None else configs.ask_prefill_config(args, model)
    except (InvalidRequest, OSError, ValueError) as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 2
    # Embedded mode's pipeline, closed once the answers or the error are printed (its close waits
    # up to --close-timeout-s for a step or compile still running: not before the user sees why).
    # Left to the interpreter's exit, its threads got a deadline of their own per kind of thread,
    # and a process that goes on (`main` in tests, a notebook) kept every ask's threads.
    opened: list[EmbeddedPipeline] = []
    try:
        return _run_ask(args, path, messages, model, prompt, template, prefill, tools, opened)
    finally:
        for pipeline in opened:
            pipeline.close()


def _run_ask(
    args: argparse.Namespace,
    path: Path | None,
    messages: list[Message] | None,
    model: ModelConfig | None,
    prompt: str | None,
    template: ChatTemplateOptions | None,
    prefill: PrefillConfig | None,
    tools: AskTools | None,
    opened: list[EmbeddedPipeline],
) -> int:
    from epd.client import EpdError
    from epd.model_runtime.loader import ModelLoadError

    try:
        asyncio.run(
            _ask_remote(args, path, messages, prompt, template, tools)
            if model is None
            else _ask_embedded(args, path, messages, model, prompt, template, prefill, tools, opened)
        )
    except KeyboardInterrupt:  # Ctrl-C ends an --interactive session; the answers are printed
        print(file=sys.stderr)
        return 130
    except AskTimedOut as exc:  # the question's deadline, the user's to change (--timeout)
        print(f"epd: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except BrokenPipeError:  # `epd ask ... | head -1`: the reader has gone, nothing failed
        return _reader_gone()
    except EpdError as exc:  # the server's status and message
        print(f"epd: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    # embedded mode: the model cannot be loaded, as `epd serve` says it (exit 3)
    except ModelLoadError as exc:
        print(f"epd: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:  # noqa: BLE001 - one message per failure for a CLI user
        if model is None and isinstance(exc, (TypeError, ValueError)):
            # Against --endpoint, the SDK's own checks of a flag's value (e.g. --top-p 2), raised
            # before any call: a usage error saying what to change, not a server's INTERNAL.
            print(f"epd: {exc}", file=sys.stderr)
            return 2
        # Embedded mode ran the servers' code in this process: name its error as they would.
        from epd.transport.errors import status_of

        code, message = status_of(exc)
        print(f"epd: {code.name}: {message}", file=sys.stderr)
        return 1
    return 0


def _check_generation(args: argparse.Namespace, embedded: bool) -> None:
    """ValueError for a generation flag's value, before the model loads or any call: the SDK's
    checks (both modes send the flags as its options), and in embedded mode the logprobs bound of
    the servers it runs in this process (a remote server holds requests to its own --max-logprobs)."""
    from epd.cli import configs
    from epd.client.request import check_generation_options
    from epd.model_runtime.sampling import check_logprobs
    from epd.prefill_svc.config import PrefillConfig

    check_generation_options(configs.generation_options(args))
    if embedded:
        bound = (
            "embedded mode's bound, vLLM's default --max-logprobs; for more, ask a server started with "
            "a larger --max-logprobs (--endpoint)"
        )
        for flag, k in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
            check_logprobs(k, PrefillConfig.max_logprobs, bound, flag)


def _template(args: argparse.Namespace) -> ChatTemplateOptions:
    """--continue-final-message / --no-add-generation-prompt / --chat-template-kwargs as the chat
    template's options (the defaults without them); ValueError, saying what to change, for the
    first two without --messages FILE (a QUESTION or --question ends with the user's question:
    nothing to continue) and for any of them with --prompt (no template); InvalidRequest for
    variables no door takes. --continue-final-message implies --no-add-generation-prompt (both true
    is refused by every door), so that the one flag is all a user needs to continue the
    assistant's message."""
    from epd.stages.messages import ChatTemplateOptions

    kwargs = _template_kwargs(args)
    given = [
        flag
        for flag, on in (
            ("--continue-final-message", args.continue_final_message),
            ("--no-add-generation-prompt", args.no_add_generation_prompt),
        )
        if on
    ]
    if not given:
        return ChatTemplateOptions(chat_template_kwargs=kwargs)
    if not args.messages or args.prompt is not None:
        raise ValueError(
            f"{' and '.join(given)} shape the chat template's end of a --messages FILE conversation: "
            "give --messages FILE (ending with the assistant's message to continue it), or drop "
            f"{' and '.join(given)}"
        )
    return ChatTemplateOptions(
        add_generation_prompt=False,
        continue_final_message=args.continue_final_message,
        chat_template_kwargs=kwargs,
    )


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-kwargs JSON as a dict ({} without it), checked as every door checks it."""
    from epd.stages.template_kwargs import check_chat_template_kwargs

    if not args.chat_template_kwargs:
        return {}
    if args.prompt is not None:
        raise ValueError(
            "--chat-template-kwargs sets the chat template's variables; --prompt has no template: drop one"
        )
    try:
        kwargs = json.loads(args.chat_template_kwargs)
    except ValueError:
        raise ValueError(
            f"--chat-template-kwargs {args.chat_template_kwargs[:80]!r} is not JSON; give an object such as "
            """'{"enable_thinking": false}'"""
        ) from None
    check_chat_template_kwargs(kwargs)
    return kwargs


def _raw_prompt(args: argparse.Namespace) -> str | None:
    """--prompt's TEXT (None without it); ValueError, saying what to drop, beside anything that
    asks a question or sends media."""
    if args.prompt is None:
        return None
    positional = [shown for shown in (args.video, args.question) if shown is not None]
    given = ([f"a VIDEO or QUESTION argument ({', '.join(repr(p[:40]) for p in positional)})"] if positional else []) + [
        flag for flag, on in (("--messages", bool(args.messages)), ("--question", bool(args.questions)),
                              ("--interactive", args.interactive), ("--no-video", args.no_video)) if on
    ]  # fmt: skip
    if given:
        raise ValueError(
            f"--prompt is a raw prompt, continued without the chat template and without media: drop "
            f"{' and '.join(given)} (or drop --prompt to ask a question: VIDEO QUESTION, or "
            f"--no-video QUESTION)"
        )
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue")
    return str(args.prompt)


def _media_path(args: argparse.Namespace) -> Path | None:
    """VIDEO's path; None with --no-video, whose one positional is the QUESTION (moved there)."""
    if args.no_video:
        if args.question is not None:
            raise ValueError("with --no-video, give the QUESTION alone (no VIDEO)")
        args.question, args.video = args.video, None
        return None
    if args.video is None:
        raise ValueError(
            "give VIDEO, the path of a video or image (or --no-video for a text-only conversation)"
        )
    path = Path(args.video)
    if not path.is_file():
        raise ValueError(_not_a_file(path))
    return path


def _reader_gone() -> int:
    """Stop as a Unix tool stops when the pipe it writes to closes: quietly, with the exit status a
    shell gives a process SIGPIPE ended (Python ignores SIGPIPE, so the write raised instead: left
    to the handler of every other error, it said "INTERNAL: internal error; the server log has
    details"). stdout goes to /dev/null first, so the interpreter's last flush has nowhere to fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _not_a_file(path: Path) -> str:
    """What is wrong with VIDEO when it is not a regular file."""
    if path.is_dir():
        return f"{path} is a directory; give the path of a video or image file"
    if path.exists():
        return f"{path} is not a regular file; give the path of a video or image file"
    return f"no such file: {path}"


def _conversational(args: argparse.Namespace) -> bool:
    return bool(args.questions) or args.interactive


def _messages(args: argparse.Namespace, template: ChatTemplateOptions) -> list[Message] | None:
    """The one-shot conversation (QUESTION as [media, QUESTION], or [QUESTION] with --no-video; or
    --messages FILE, - for stdin, checked against `template`); None when the questions are asked
    in turn (--question / --interactive)."""
    from epd.stages.messages import Message, check_messages, from_chat_template, media_type, question_messages

    if args.messages and _conversational(args):
        raise ValueError("--messages FILE cannot be combined with --question or --interactive")
    if _conversational(args):
        if any(not q.strip() for q in args.questions) or (
            args.question is not None and not args.question.strip()
        ):
            raise ValueError("a question is empty; ask something about the video")
        return None
    if (args.question is None) == (not args.messages):
        raise ValueError("give a QUESTION or --messages FILE (one of them)")
    if not args.messages:
        if args.no_video and not args.question.strip():
            raise ValueError("the question is empty; ask something")
        return [Message.user(args.question)] if args.no_video else question_messages(args.question)
    source = sys.stdin.read() if args.messages == "-" else Path(args.messages).read_text(encoding="utf-8")
    messages = from_chat_template(json.loads(source))
    # now, not after the model loads: exit 2, saying what to change
    check_messages(messages, template=template)
    if bool(media_type(messages)) == args.no_video:
        raise ValueError(
            "the messages have a video or image part: give VIDEO instead of --no-video"
            if args.no_video
            else "the messages have no video or image part: add one, or ask with --no-video"
        )
    return messages


async def _questions(args: argparse.Namespace) -> AsyncIterator[str]:
    """QUESTION, each --question, then (--interactive) stdin's lines until EOF or an empty one."""
    for question in ([args.question] if args.question is not None else []) + list(args.questions):
        if not args.json:
            print(f"> {question}", file=sys.stderr, flush=True)
        yield question
    if not args.interactive:
        return
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("question (empty line to end)> ", end="", file=sys.stderr, flush=True)
        # In a thread: the event loop keeps serving the channel (or the embedded engines) meanwhile.
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line.strip():
            return
        if not tty and not args.json:
            print(f"> {line.strip()}", file=sys.stderr, flush=True)
        yield line.strip()


class AskTimedOut(Exception):
    """A question's --timeout passed before its answer ended (`_within_timeout`)."""

    def __init__(self, timeout_s: float, given: bool) -> None:
        where = "--timeout" if given else "the SDK's default deadline with --endpoint; --timeout sets it"
        super().__init__(
            f"no answer within {timeout_s:g} s ({where}): raise --timeout, or ask for less "
            "(fewer --max-new-tokens, --num-frames or --max-frames)"
        )


async def _within_timeout(
    stream: AsyncGenerator[StreamEvent, None], timeout_s: float | None, given: bool
) -> AsyncGenerator[StreamEvent, None]:
    """One question's `stream`, ended by AskTimedOut once `timeout_s` has passed since it began
    (None: no deadline). It is the request's client deadline for the stages it runs in this
    process (`set_client_deadline`: their tasks inherit it; prefill's render checks read it), and
    at the deadline the stream is cancelled, as gRPC ends a front door's call (embedded mode has
    none to end it); a remote stream's SDK call carries it as its gRPC deadline itself, and its
    DEADLINE_EXCEEDED once it passed is the same AskTimedOut. `given`: by --timeout (the message
    says so), not the SDK's default."""
    from epd.client import EpdError
    from epd.client.client import DEADLINE_CLOCK_SLACK_S
    from epd.stages.deadline import set_client_deadline
    from epd.stages.errors import DeadlineExceeded

    if timeout_s is None:
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield item
        return
    end_at = time.monotonic() + timeout_s
    set_client_deadline(timeout_s)
    async with contextlib.aclosing(stream):  # at the deadline: its stage calls cancelled now
        while True:
            limit = asyncio.timeout(max(0.0, end_at - time.monotonic()))
            try:
                async with limit:
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except Exception as exc:
                # Ours: the timer fired (whatever the cancelled stream raised), or a stage or the
                # SDK saw the same deadline pass a moment before the timer.
                late = time.monotonic() >= end_at - DEADLINE_CLOCK_SLACK_S
                deadline_error = isinstance(exc, DeadlineExceeded) or (
                    isinstance(exc, EpdError) and exc.code.name == "DEADLINE_EXCEEDED"
                )
                if limit.expired() or (late and deadline_error):
                    raise AskTimedOut(timeout_s, given) from None
                raise
            yield item


async def _print_turns(
    args: argparse.Namespace,
    turns: AsyncIterator[tuple[str, AsyncGenerator[StreamEvent, None]]],
    notice: str,
    tools: AskTools | None = None,
    timeout_s: float | None = None,
    timeout_given: bool = True,
) -> None:
    """Run each turn's stream, showing it as it comes, then print its result. With `tools` that
    read the answer for calls, the answer is shown once whole: its content, then its calls.
    `timeout_s`: each turn's deadline (`_within_timeout`; None: none), `timeout_given` by --timeout
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
        items = _within_timeout(stream, timeout_s, timeout_given)
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
            if _conversational(args):
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


async def _ask_embedded(
    args: argparse.Namespace,
    path: Path | None,
    messages: list[Message] | None,
    model: ModelConfig,
    prompt: str | None = None,
    template: ChatTemplateOptions | None = None,
    prefill: PrefillConfig | None = None,
    tools: AskTools | None = None,
    opened: list[EmbeddedPipeline] | None = None,
) -> None:
    """`opened`: where the pipeline is put for the caller to close (`run_ask`)."""
    from epd.video.media_open import sniff_container

    media = None if path is None else path.read_bytes()  # None: --no-video
    if media is not None:
        sniff_container(media)  # an unsupported file is refused now, before the model loads (seconds)
    from epd.cli import configs
    from epd.client.conversation import History
    from epd.decode_svc.config import DecodeConfig
    from epd.encoder_svc.config import EncoderConfig
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.default_model import accuracy_notice, is_meaningless
    from epd.model_runtime.loader import resolve_model_path
    from epd.stages.raw_prompt import RawPrompt

    model_path = resolve_model_path(model.model)
    notice = _notice(is_meaningless(model_path), args.json) or _say(accuracy_notice(model_path), args.json)
    if not args.json:
        print(f"epd: loading {model_path} (embedded mode)", file=sys.stderr, flush=True)
    # One pipeline for every turn: its encoder and prefix caches serve the follow-ups.
    policy = configs.ask_scheduling_policy(args)
    pipeline = build_embedded_pipeline(
        model,
        encoder=EncoderConfig(model=model, scheduling_policy=policy),
        prefill=prefill,
        decode=DecodeConfig(model=model, scheduling_policy=policy),
        close_timeout_s=args.close_timeout_s,
    )
    if opened is not None:
        opened.append(pipeline)

    async def turns() -> AsyncIterator[tuple[str, AsyncGenerator[StreamEvent, None]]]:
        if prompt is not None:
            yield "", _embedded_stream(args, pipeline, None, [], raw_prompt=RawPrompt(text=prompt))
            return
        if messages is not None:
            yield "", _embedded_stream(args, pipeline, media, messages, template=template, tools=tools)
            return
        history = History(with_media=media is not None)
        async for question in _questions(args):
            answer: list[str] = []
            yield (
                question,
                _embedded_stream(
                    args, pipeline, media, history.messages_for(question), answer, template=template
                ),
            )
            history.add(question, answer[0])

    await _print_turns(args, turns(), notice, tools, args.timeout)


async def _embedded_stream(
    args: argparse.Namespace,
    pipeline: Pipeline,
    media: bytes | None,
    messages: list[Message],
    answer: list[str] | None = None,
    raw_prompt: RawPrompt | None = None,
    template: ChatTemplateOptions | None = None,
    tools: AskTools | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """The embedded pipeline's answer as the SDK's stream events (what a remote turn yields);
    the answer's text is appended to `answer` for the caller's history. `raw_prompt`: instead
    of `messages` (then []). `template`: how the chat template ends `messages` (None: the defaults).
    `tools`: rendered into the prompt, a forced choice's structured output on the answer."""
    from dataclasses import replace

    from epd.cli import configs
    from epd.client import StageEvent as ClientStageEvent
    from epd.client import TokenDelta
    from epd.gateway.ask_types import AskRequest, AskSummary
    from epd.stages.contracts import MediaInput, StageEvent, TokenStep
    from epd.stages.messages import ChatTemplateOptions
    from epd.stages.names import Stage

    generation = configs.generation_config(args)
    template = template or ChatTemplateOptions()
    if tools is not None:
        template = replace(template, tools=tools.tools)
        if tools.forced is not None:
            generation = replace(generation, structured_outputs=tools.forced)
    request = AskRequest(
        messages=messages,
        media=None if media is None else MediaInput(media),
        sampling=configs.sampling_options(args),
        generation=generation,
        pruning=configs.pruning_config(args),
        cache_salt=args.cache_salt,
        raw_prompt=raw_prompt,
        template=template,
    )
    started = time.perf_counter()
    events: list[ClientStageEvent] = []
    async for item in pipeline.ask(request):
        if isinstance(item, StageEvent):
            at_ms = (time.perf_counter() - started) * 1e3
            event = ClientStageEvent(Stage.of(item.stage), item.state, at_ms, item.duration_ms, item.details)
            events.append(event)
            yield event
        elif isinstance(item, AskSummary):
            result = _result_of(item, events)
            if answer is not None:
                answer.append(result.answer)
            yield result
            return
        elif isinstance(item, TokenStep):  # the prompt's logprobs are printed from the result
            yield TokenDelta(list(item.token_ids), item.text)


def _result_of(summary: AskSummary, events: list[ClientStageEvent]) -> AskResult:
    """The pipeline's own summary as the SDK's result, so that both modes print the same thing:
    through the gateway's converter and the SDK's, the path a remote answer takes (the prompt's
    logprobs beside it, as the SDK joins them from the pieces before the summary)."""
    from epd.client.types import result_from_proto
    from epd.gateway.servicer import summary_to_proto

    prompt_logprobs = None if summary.prompt_logprobs is None else list(summary.prompt_logprobs)
    return result_from_proto(summary_to_proto(summary), events, prompt_logprobs)


def _check_tls_flags(args: argparse.Namespace) -> None:
    tls = {
        "--tls-ca": args.tls_ca,
        "--tls-cert": args.tls_cert,
        "--tls-key": args.tls_key,
        "--tls-server-name": args.tls_server_name,
    }
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError(
            "--tls-cert and --tls-key go together: pass both (the client certificate and its key)"
        )
    # Read them now: the client reads them inside the event loop, where a missing file would be
    # reported as a server's INTERNAL error rather than as this flag's.
    for flag in ("--tls-ca", "--tls-cert", "--tls-key"):
        if path := tls[flag]:
            try:
                pem = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
            if b"-----BEGIN " not in pem:
                raise ValueError(f"{flag} {path}: not a PEM file (expected -----BEGIN ...-----)")
    if args.tls_cert:  # a key not of the certificate fails every handshake, as UNAVAILABLE
        import ssl

        try:
            ssl.create_default_context().load_cert_chain(args.tls_cert, args.tls_key)
        except ssl.SSLError as exc:
            raise ValueError(
                f"--tls-cert/--tls-key: not a certificate and its matching key ({exc})"
            ) from None


async def _ask_remote(
    args: argparse.Namespace,
    path: Path | None,
    messages: list[Message] | None,
    prompt: str | None = None,
    template: ChatTemplateOptions | None = None,
    tools: AskTools | None = None,
) -> None:
    from epd.cli import configs
    from epd.client import AsyncEpdClient
    from epd.stages.messages import ChatTemplateOptions

    # Zero and empty mean "the server's default"; the server checks and parses every option.
    options: dict = dict(
        fps=args.fps, max_frames=args.max_frames, num_frames=args.num_frames, max_pixels=args.max_pixels,
        **configs.generation_options(args), pruning=args.pruning, pruning_knobs=dict(args.pruning_knob),
        cache_salt=args.cache_salt,
    )  # fmt: skip
    if tools is not None:  # the SDK's tools=, and a forced choice's structured output
        options["tools"] = list(tools.tools)
        if tools.forced is not None:
            options["structured_outputs"] = tools.forced
    tls = dict(
        root_certificates_path=args.tls_ca,
        client_certificate_path=args.tls_cert,
        client_key_path=args.tls_key,
        server_name_override=args.tls_server_name,
    )
    # --timeout: each question's gRPC deadline (the SDK's timeout_s; its default without the flag)
    timeout: dict[str, Any] = {} if args.timeout is None else {"timeout_s": args.timeout}
    async with AsyncEpdClient(
        args.endpoint, api_key=args.api_key, tls=bool(args.tls_ca), **timeout, **tls
    ) as client:

        async def turns() -> AsyncIterator[tuple[str, AsyncGenerator[StreamEvent, None]]]:
            if prompt is not None:
                yield "", client.stream(None, prompt=prompt, **options)
                return
            if messages is not None:
                # The SDK's names; unset (the server's defaults) without the flags.
                shape: dict[str, Any] = (
                    {}
                    if template is None or template == ChatTemplateOptions()
                    else dict(
                        add_generation_prompt=template.add_generation_prompt,
                        continue_final_message=template.continue_final_message,
                        chat_template_kwargs=dict(template.chat_template_kwargs),
                    )
                )
                yield "", client.stream(path, messages=messages, **options, **shape)
                return
            # The SDK's conversation: the video goes up once, later turns send its sha256 (None:
            # --no-video, a text-only conversation).
            if template is not None and template.chat_template_kwargs:
                options["chat_template_kwargs"] = dict(template.chat_template_kwargs)
            chat = client.conversation(path, **options)
            async for question in _questions(args):
                yield question, chat.stream(question)

        await _print_turns(args, turns(), "", tools, client.timeout_s, args.timeout is not None)


def _say(text: str, quiet: bool) -> str:
    if text and not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text


def _notice(meaningless: bool, quiet: bool) -> str:
    if not meaningless:
        return ""
    text = (
        "this is epd's randomly initialised default model: it runs the real pipeline, "
        "but its answers are meaningless"
    )
    if not quiet:
        print(f"epd: NOTE: {text}", file=sys.stderr, flush=True)
    return text
