"""`epd ask` in embedded mode: the whole pipeline in this process (no ports), one for every turn,
its answers as the SDK's stream events and result, so that both modes print the same thing."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from epd.cli.ask_inputs import questions_in_turn
from epd.cli.ask_output import demo_model_notice, print_turns, say_note

if TYPE_CHECKING:
    from epd.cli.ask_tools import AskTools
    from epd.client import AskResult, StreamEvent
    from epd.client import StageEvent as ClientStageEvent
    from epd.gateway.ask_types import AskSummary
    from epd.gateway.embedded import EmbeddedPipeline
    from epd.gateway.pipeline import Pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.sampling import GenerationConfig
    from epd.prefill_svc.config import PrefillConfig
    from epd.stages.messages import ChatTemplateOptions, Message
    from epd.stages.raw_prompt import RawPrompt


async def ask_embedded(
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
    from epd.model_runtime.generation_defaults import announce_at_start
    from epd.model_runtime.hf_loading import hide_transformers_bars
    from epd.model_runtime.loader import resolve_model_path
    from epd.stages.raw_prompt import RawPrompt

    model_path = resolve_model_path(model.model)
    notice = demo_model_notice(is_meaningless(model_path), args.json) or say_note(
        accuracy_notice(model_path), args.json
    )
    if not args.json:
        print(f"epd: loading {model_path} (embedded mode)", file=sys.stderr, flush=True)
    # One progress display on stderr, ours (the line above, then each stage's): transformers drew its
    # "Loading weights" bar beside it. Warnings and errors are log lines and messages, not bars: they
    # stay, and so do the hub's download bars (a first download is the long part).
    hide_transformers_bars()
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
    # vLLM's `LLM.generate` too: the model's sampling defaults (`get_default_sampling_params`),
    # resolved as the server's front door resolves them (auto: its prefill's model info).
    generation = configs.generation_defaults_flags(args)
    announce_at_start(generation)
    defaults = await pipeline.request_defaults(generation)

    async def turns() -> AsyncIterator[tuple[str, AsyncGenerator[StreamEvent, None]]]:
        if prompt is not None:
            yield "", _embedded_stream(args, pipeline, defaults, None, [], raw_prompt=RawPrompt(text=prompt))
            return
        if messages is not None:
            yield (
                "",
                _embedded_stream(args, pipeline, defaults, media, messages, template=template, tools=tools),
            )
            return
        history = History(with_media=media is not None)
        async for question in questions_in_turn(args):
            answer: list[str] = []
            yield (
                question,
                _embedded_stream(
                    args, pipeline, defaults, media, history.messages_for(question), answer, template=template
                ),
            )
            history.add(question, answer[0])

    await print_turns(args, turns(), notice, tools, args.timeout)


async def _embedded_stream(
    args: argparse.Namespace,
    pipeline: Pipeline,
    defaults: GenerationConfig,
    media: bytes | None,
    messages: list[Message],
    answer: list[str] | None = None,
    raw_prompt: RawPrompt | None = None,
    template: ChatTemplateOptions | None = None,
    tools: AskTools | None = None,
) -> AsyncGenerator[StreamEvent, None]:
    """The embedded pipeline's answer as the SDK's stream events (what a remote turn yields);
    the answer's text is appended to `answer` for the caller's history. `defaults`: what the
    generation flags left unset take (`configs.generation_defaults_flags`). `raw_prompt`: instead
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

    generation = configs.generation_config(args, defaults)
    template = template or ChatTemplateOptions()
    if tools is not None:
        template = replace(template, tools=tools.tools)
        if tools.forced is not None:
            generation = replace(generation, structured_outputs=tools.forced)
    # --structured-outputs-config, as the server's front door applies it to every request's spec
    generation = configs.structured_outputs_config(args).applied(generation)
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
