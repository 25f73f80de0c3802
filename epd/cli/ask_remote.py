"""`epd ask --endpoint`: the questions through the SDK's client (`epd.client.AsyncEpdClient`)."""

from __future__ import annotations

import argparse
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd.cli.ask_inputs import questions_in_turn
from epd.cli.ask_output import print_turns

if TYPE_CHECKING:
    from epd.cli.ask_tools import AskTools
    from epd.client import StreamEvent
    from epd.stages.messages import ChatTemplateOptions, Message


async def ask_remote(
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
            async for question in questions_in_turn(args):
                yield question, chat.stream(question)

        await print_turns(args, turns(), "", tools, client.timeout_s, args.timeout is not None)
