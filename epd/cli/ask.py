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
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from epd.cli.ask_embedded import ask_embedded
from epd.cli.ask_inputs import (
    chat_template_options,
    check_generation_flags,
    check_tls_flags,
    media_path,
    one_shot_messages,
    raw_prompt_text,
)
from epd.cli.ask_remote import ask_remote
from epd.cli.ask_timeout import AskTimedOut

EXIT_TIMEOUT = 124
"""`epd ask`'s exit status when a question's --timeout passed before its answer ended (GNU
timeout's). The others: 0 answered, 1 a server's error, 2 a bad flag or input, 3 a model that cannot
be loaded (embedded), 130 Ctrl-C, 141 (128 + SIGPIPE) the answer's reader closed the pipe."""


if TYPE_CHECKING:
    from epd.cli.ask_tools import AskTools
    from epd.gateway.embedded import EmbeddedPipeline
    from epd.model_runtime.config import ModelConfig
    from epd.prefill_svc.config import PrefillConfig
    from epd.stages.messages import ChatTemplateOptions, Message


def run_ask(args: argparse.Namespace) -> int:
    from epd.cli import configs
    from epd.cli.ask_tools import ask_tools
    from epd.stages.errors import InvalidRequest

    try:
        template = chat_template_options(args)
        prompt = raw_prompt_text(args)
        path = None if prompt is not None else media_path(args)
        messages = None if prompt is not None else one_shot_messages(args, template)
        tools = ask_tools(args)
        check_tls_flags(args)
        if args.fps is not None and args.num_frames:  # what every door refuses (ONE_FRAME_CHOICE)
            raise ValueError(
                "--fps and --num-frames: give one (--num-frames N: exactly N frames; "
                "--fps F: F frames per second, at most --max-frames)"
            )
        # Embedded mode's model config now: a bad --device or --dtype is the user's to fix (exit 2),
        # not a server error out of the event loop (INTERNAL, exit 1).
        model = None if args.endpoint else configs.model_config(args)
        check_generation_flags(args, embedded=model is not None)
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
            ask_remote(args, path, messages, prompt, template, tools)
            if model is None
            else ask_embedded(args, path, messages, model, prompt, template, prefill, tools, opened)
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


def _reader_gone() -> int:
    """Stop as a Unix tool stops when the pipe it writes to closes: quietly, with the exit status a
    shell gives a process SIGPIPE ended (Python ignores SIGPIPE, so the write raised instead: left
    to the handler of every other error, it said "INTERNAL: internal error; the server log has
    details"). stdout goes to /dev/null first, so the interpreter's last flush has nowhere to fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE
