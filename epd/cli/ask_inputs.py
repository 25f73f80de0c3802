"""`epd ask`'s flags and arguments read into what it asks (the chat template's options, a raw
prompt, the media's path, the one-shot messages or the questions asked in turn) and checked, before
the model loads or any call: a bad one is the user's to fix (exit 2), saying what to change."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epd.stages.messages import ChatTemplateOptions, Message


def check_generation_flags(args: argparse.Namespace, embedded: bool) -> None:
    """ValueError for a generation flag's value, before the model loads or any call: the SDK's
    checks (both modes send the flags as its options), and in embedded mode the logprobs bound of
    the servers it runs in this process (a remote server holds requests to its own --max-logprobs)."""
    from epd.cli import configs
    from epd.client.request import check_generation_options
    from epd.model_runtime.sampling import check_logprobs
    from epd.prefill_svc.config import PrefillConfig

    check_generation_options(configs.generation_options(args))
    if embedded:  # --generation-config's folder and the override, before the model loads
        configs.generation_defaults_flags(args)
        bound = (
            "embedded mode's bound, vLLM's default --max-logprobs; for more, ask a server started with "
            "a larger --max-logprobs (--endpoint)"
        )
        for flag, k in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
            check_logprobs(k, PrefillConfig.max_logprobs, bound, flag)


def chat_template_options(args: argparse.Namespace) -> ChatTemplateOptions:
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


def raw_prompt_text(args: argparse.Namespace) -> str | None:
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


def media_path(args: argparse.Namespace) -> Path | None:
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


def _not_a_file(path: Path) -> str:
    """What is wrong with VIDEO when it is not a regular file."""
    if path.is_dir():
        return f"{path} is a directory; give the path of a video or image file"
    if path.exists():
        return f"{path} is not a regular file; give the path of a video or image file"
    return f"no such file: {path}"


def asks_in_turns(args: argparse.Namespace) -> bool:
    return bool(args.questions) or args.interactive


def one_shot_messages(args: argparse.Namespace, template: ChatTemplateOptions) -> list[Message] | None:
    """The one-shot conversation (QUESTION as [media, QUESTION], or [QUESTION] with --no-video; or
    --messages FILE, - for stdin, checked against `template`); None when the questions are asked
    in turn (--question / --interactive)."""
    from epd.stages.messages import Message, check_messages, from_chat_template, media_type, question_messages

    if args.messages and asks_in_turns(args):
        raise ValueError("--messages FILE cannot be combined with --question or --interactive")
    if asks_in_turns(args):
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


async def questions_in_turn(args: argparse.Namespace) -> AsyncIterator[str]:
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


def check_tls_flags(args: argparse.Namespace) -> None:
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
