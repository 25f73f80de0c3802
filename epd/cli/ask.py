"""`epd ask VIDEO QUESTION`: embedded (one process, no ports) or against --endpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from epd.cli import configs


def run_ask(args: argparse.Namespace) -> int:
    path = Path(args.video)
    if not path.is_file():
        print(f"epd: no such file: {path}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_ask_remote(args, path) if args.endpoint else _ask_embedded(args, path))
    except Exception as exc:  # noqa: BLE001 - one message per failure for a CLI user
        from epd.transport.errors import status_of

        code, message = status_of(exc)
        if hasattr(exc, "code") and hasattr(exc, "message"):  # epd_client.EpdError
            code, message = exc.code, exc.message
        print(f"epd: {code.name}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
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


async def _ask_embedded(args: argparse.Namespace, path: Path) -> dict:
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.gateway.pipeline import AskRequest, AskSummary
    from epd.model_runtime.default_model import accuracy_notice, is_meaningless
    from epd.model_runtime.loader import resolve_model_path
    from epd.stages.contracts import MediaInput, StageEvent

    model = configs.model_config(args)
    model_path = resolve_model_path(model.model)
    notice = _notice(is_meaningless(model_path), args.json) or _say(accuracy_notice(model_path), args.json)
    if not args.json:
        print(f"epd: loading {model_path} (embedded mode)", file=sys.stderr, flush=True)
    pipeline = build_embedded_pipeline(model)
    request = AskRequest(
        question=args.question,
        media=MediaInput(path.read_bytes()),
        sampling=configs.sampling_options(args),
        generation=configs.generation_config(args),
        pruning=configs.pruning_config(args),
    )
    summary = None
    async for item in pipeline.ask(request):
        if isinstance(item, StageEvent):
            _progress(item.stage, item.state, item.duration_ms, args.json)
        elif isinstance(item, AskSummary):
            summary = item
        else:
            _emit_text(item.text, args.json)
    assert summary is not None
    if not args.json:
        print(file=sys.stdout)
    return _result(summary.answer, summary.token_ids, summary.num_frames, summary.num_visual_tokens,
                   summary.timings_ms, summary.finish_reason, summary.kv_num_bytes, notice,
                   summary.pruning.to_dict())


async def _ask_remote(args: argparse.Namespace, path: Path) -> dict:
    from epd.client import AsyncEpdClient

    sampling = configs.sampling_options(args)
    generation = configs.generation_config(args)
    options: dict = dict(
        fps=sampling.fps, max_frames=sampling.max_frames, num_frames=sampling.num_frames or 0,
        max_pixels=sampling.max_pixels or 0, max_new_tokens=generation.max_new_tokens,
        temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k,
        seed=generation.seed, stop=list(generation.stop),
        pruning=args.pruning, pruning_knobs=dict(args.pruning_knob),
    )
    async with AsyncEpdClient(args.endpoint, api_key=args.api_key) as client:
        async for msg in client.ask_stream(path, args.question, **options):
            kind = msg.WhichOneof("kind")
            if kind == "event":
                _progress(msg.event.stage, msg.event.state, msg.event.duration_ms, args.json)
            elif kind == "delta":
                _emit_text(msg.delta.text, args.json)
            else:
                s = msg.summary
    if not args.json:
        print(file=sys.stdout)
    from epd.transport.convert import stats_from_proto

    return _result(s.answer, list(s.token_ids), s.num_frames, s.num_visual_tokens, dict(s.timings_ms),
                   s.finish_reason, s.kv_num_bytes, "", stats_from_proto(s.pruning).to_dict())


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


def _result(answer, token_ids, num_frames, num_visual_tokens, timings_ms, finish_reason, kv_num_bytes, notice,
            pruning):
    out = {
        "answer": answer,
        "token_ids": token_ids,
        "num_frames": num_frames,
        "num_visual_tokens": num_visual_tokens,
        "timings_ms": timings_ms,
        "finish_reason": finish_reason,
        "kv_num_bytes": kv_num_bytes,
        "pruning": pruning,
    }
    if notice:
        out["notice"] = notice
    return out
