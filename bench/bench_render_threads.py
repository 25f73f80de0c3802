"""What prefill's render threads cost and buy: the hop of one render to a tokenizer thread against
rendering on the caller's thread, and what a request with the server's chat template waits while
slow request templates (--trust-request-chat-template) render.

    PYTHONPATH=. .venv/bin/python bench/bench_render_threads.py --num-renders 400 --slow-loop 5000000

The model is the tiny Qwen2-VL (`epd.model_runtime.tiny_model`, its real processor, template and
fast tokenizer), built in a temporary folder; one process, no server.

1. hop: `PrefillEngine.render` of a text-only conversation (--turns user/assistant turns of a
   sentence each), alternately on the calling thread (the event loop's, as before prompts moved
   off the model thread: what the model thread paid) and through `LocalPrefillStage._render` (the
   tokenizer thread, awaited from the loop, with the checks between its steps): median
   microseconds per render of each, their ratio and difference (the hop: submit, the thread's
   wake-up, the loop's wake-up).
2. request templates: --num-slow renders of a request's own template whose loop takes a while
   (--slow-loop iterations of jinja's `for`) run at once, and meanwhile renders with the server's
   template (the model's) run one after another: their median and longest milliseconds, on threads
   of their own for request templates (this tree: `REQUEST_TEMPLATE_THREADS`) and sharing the
   tokenizer threads (before), beside one slow render's time alone.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for mypy; the functions import it when they run (--help stays quick)
    from epd.prefill_svc.stage import LocalPrefillStage

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SENTENCE = "a red circle moves to the left while a blue square stays where it was"


def _conversation(num_turns: int) -> list[dict]:
    turns = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": [{"type": "text", "text": f"{SENTENCE} ({i})"}],
        }
        for i in range(num_turns)
    ]
    return [{"role": "system", "content": [{"type": "text", "text": "answer briefly"}]}, *turns]


def _slow_template(num_loops: int) -> str:
    """A template whose loop runs `num_loops` iterations (rounded to thousands: the sandbox's
    ranges are at most 100,000 long), then renders the conversation."""
    return (
        f"{{% for i in range({max(1, num_loops // 1000)}) %}}{{% for j in range(1000) %}}{{% endfor %}}{{% endfor %}}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content[-1].text }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _stage(model_dir: Path) -> LocalPrefillStage:
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.loader import load_adapter
    from epd.prefill_svc.config import PrefillConfig
    from epd.prefill_svc.engine import PrefillEngine
    from epd.prefill_svc.kv_store import KvStore
    from epd.prefill_svc.stage import LocalPrefillStage
    from epd.stages.model_thread import ModelThread

    adapter = load_adapter(ModelConfig(model=str(model_dir)), "prefill")
    engine = PrefillEngine(PrefillConfig(trust_request_chat_template=True), adapter)
    return LocalPrefillStage(engine, KvStore(1 << 30, 600.0), ModelThread())


def _render_call(stage: LocalPrefillStage, messages, template: str | None = None):
    from epd.model_runtime.sampling import GenerationConfig
    from epd.stages.messages import ChatTemplateOptions

    return functools.partial(
        stage.engine.render,
        messages,
        None,
        GenerationConfig(max_new_tokens=1),
        template=ChatTemplateOptions(chat_template=template),
    )


async def _hop(stage: LocalPrefillStage, num_renders: int, num_turns: int) -> tuple[float, float, int]:
    from epd.stages.messages import from_chat_template

    messages = from_chat_template(_conversation(num_turns))
    render = _render_call(stage, messages)
    here_s, there_s = [], []
    num_tokens = render().num_prompt_tokens
    await stage._render(render, "warm", False)
    for i in range(num_renders):
        started = time.perf_counter()
        render()
        here_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        await stage._render(render, f"r{i}", False)
        there_s.append(time.perf_counter() - started)
    return statistics.median(here_s), statistics.median(there_s), num_tokens


async def _slow_alone(stage: LocalPrefillStage, slow_loop: int) -> float:
    """Seconds of one slow render with nothing else running (its template compiled before)."""
    from epd.stages.messages import from_chat_template

    render = _render_call(stage, from_chat_template(_conversation(2)), _slow_template(slow_loop))
    await stage._render(render, "warm", True)
    started = time.perf_counter()
    await stage._render(render, "alone", True)
    return time.perf_counter() - started


async def _behind_slow(
    stage: LocalPrefillStage, num_slow: int, slow_loop: int, shared: bool
) -> tuple[list[float], float]:
    """Renders with the server's template while `num_slow` slow request templates render: each one's
    seconds, and the seconds until the slow ones all ended."""
    from epd.stages.messages import from_chat_template

    if shared:  # before: one pool of threads for every render
        stage._template_pool = stage._tokenizer_pool
    messages = from_chat_template(_conversation(2))
    slow_render = _render_call(stage, messages, _slow_template(slow_loop))
    fast_render = _render_call(stage, messages)
    started = time.perf_counter()
    slow = [asyncio.ensure_future(stage._render(slow_render, f"s{i}", True)) for i in range(num_slow)]
    await asyncio.sleep(0)  # each slow one submitted to a thread
    fast_s = []
    while not all(s.done() for s in slow):
        began = time.perf_counter()
        await stage._render(fast_render, "f", False)
        fast_s.append(time.perf_counter() - began)
    await asyncio.gather(*slow)
    return fast_s, time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-renders", type=int, default=400, help="renders of each kind in the hop part")
    ap.add_argument(
        "--turns", type=int, default=4, help="user/assistant turns of the hop part's conversation"
    )
    ap.add_argument("--num-slow", type=int, default=4, help="slow request templates rendering at once")
    ap.add_argument("--slow-loop", type=int, default=5_000_000, help="iterations of the slow template's loop")
    args = ap.parse_args()
    from epd.model_runtime.threads import pin_torch_threads
    from epd.model_runtime.tiny_model import TinyVLMSpec, build_checkpoint
    from epd.prefill_svc.stage import REQUEST_TEMPLATE_THREADS, TOKENIZER_THREADS

    pin_torch_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / "qwen2_vl", TinyVLMSpec(family="qwen2_vl"))
        stage = _stage(model_dir)
        here_s, there_s, num_tokens = asyncio.run(_hop(stage, args.num_renders, args.turns))
        print(f"hop: {num_tokens}-token prompt, {args.num_renders} renders each, median")
        print(f"  caller's thread    {here_s * 1e6:8.0f} us")
        print(f"  tokenizer thread   {there_s * 1e6:8.0f} us   ratio {there_s / here_s:.2f}x, "
              f"hop {(there_s - here_s) * 1e6:.0f} us")  # fmt: skip
        stage.close_tokenizer()
        stage.model_thread.close()

        alone = _stage(model_dir)
        slow_alone_s = asyncio.run(_slow_alone(alone, args.slow_loop))
        alone.close_tokenizer()
        alone.model_thread.close()
        print(
            f"\nrequest templates: {args.num_slow} slow ones at once (one alone: {slow_alone_s * 1e3:.0f} ms); "
            f"{TOKENIZER_THREADS} tokenizer threads, {REQUEST_TEMPLATE_THREADS} for request templates"
        )
        print(
            "  design                 server-template renders meanwhile: n, median ms, longest ms; slow ones' end"
        )
        for name, shared in (("own threads (this)", False), ("shared (before)", True)):
            stage = _stage(model_dir)
            fast_s, all_s = asyncio.run(_behind_slow(stage, args.num_slow, args.slow_loop, shared))
            print(
                f"  {name:22s} {len(fast_s):5d} {statistics.median(fast_s) * 1e3:8.1f} "
                f"{max(fast_s) * 1e3:8.1f}   {all_s * 1e3:.0f} ms"
            )
            stage.close_tokenizer()
            stage.model_thread.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
