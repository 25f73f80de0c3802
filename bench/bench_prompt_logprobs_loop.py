"""How long the request with the most prompt logprobs stalls the gateway's event loop, which every
other request's stream shares: a concurrent stream's largest gap between two tokens while that
request's answer is joined, answered over HTTP and sent on the Ask stream, each step on the loop
(as before) and off it (`PrefillAnswer.add`, `json_answer`, `prompt_logprobs_pieces_off_loop`);
then the SDK's event loop while it joins the Ask stream's pieces into `AskResult.prompt_logprobs`.

    PYTHONPATH=. python bench/bench_prompt_logprobs_loop.py
    PYTHONPATH=. python bench/bench_prompt_logprobs_loop.py --k 5 --token-interval-ms 20
    PYTHONPATH=. python bench/bench_prompt_logprobs_loop.py --steps 3,4

No model and no servers: the gateway's own steps on MAX_PROMPT_LOGPROB_ENTRIES entries made up as
bench/bench_prompt_logprobs_memory.py makes them (`at_the_bound`), in one event loop beside a "stream" that wakes
every --token-interval-ms (a decoder's tokens) and notes its largest gap; without the big answer,
that gap is the interval plus the loop's own jitter (the first line). Throughout, the gateway holds
one such answer joined (what steps 2 and 3 read), as it would while a request is answered: every
full garbage collection walks whatever Python objects it is made of.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.bench.bench_prompt_logprobs_memory import at_the_bound  # noqa: E402
from epd.gateway.json_answer import json_answer  # noqa: E402
from epd.gateway.logprobs_protocol import prompt_logprobs_json  # noqa: E402
from epd.model_runtime.logprobs import TokenLogprob  # noqa: E402
from epd.transport import convert  # noqa: E402
from epd.v1 import gateway_pb2, prefill_pb2  # noqa: E402


async def largest_gap_s(step: Callable[[], Awaitable[object]], interval_s: float) -> tuple[float, float, int]:
    """(the stream's largest gap between tokens while `step` runs, `step`'s seconds, the full
    garbage collections meanwhile: each walks every live object, the half million entries too,
    holding the GIL on whichever thread set it off)."""
    gaps: list[float] = []
    done = False
    full_collections = 0

    def count(phase: str, info: dict) -> None:
        nonlocal full_collections
        full_collections += phase == "stop" and info["generation"] == 2

    async def stream() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(interval_s)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(stream())
    await asyncio.sleep(5 * interval_s)
    gaps.clear()
    gc.callbacks.append(count)
    started = time.perf_counter()
    try:
        await step()
    finally:
        gc.callbacks.remove(count)
    seconds = time.perf_counter() - started
    done = True
    await ticking
    return max(gaps, default=0.0), seconds, full_collections


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=20, help="top tokens a position (vLLM's most by default)")
    parser.add_argument("--token-chars", type=int, default=6, help="characters of each token's text")
    parser.add_argument("--token-interval-ms", type=float, default=10.0, help="the other stream's pace")
    parser.add_argument(
        "--steps", default="1,2,3,4", help="which steps to run (a commit before step 4 has none)"
    )
    args = parser.parse_args()
    steps = {int(step) for step in args.steps.split(",")}
    interval_s = args.token_interval_ms / 1000
    handle, responses = at_the_bound(args.k, args.token_chars)
    num_tokens = handle.num_prompt_tokens
    del handle  # the made-up list: the gateway holds only what it joined (`held`), which 2 and 3 read

    async def joined() -> Sequence[TokenLogprob]:
        answer = convert.PrefillAnswer()
        for data in responses:
            await answer.add(prefill_pb2.PrefillResponse.FromString(data))
        return answer.handle(relay=True).prompt_logprobs or []

    logprobs = asyncio.run(joined())

    async def idle() -> None:
        await asyncio.sleep(1.0)

    async def join(on_loop: bool) -> None:
        answer = convert.PrefillAnswer()
        for data in responses:  # as grpc hands them over: the loop free between messages
            response = prefill_pb2.PrefillResponse.FromString(data)
            if on_loop:
                answer._add(response)
                await asyncio.sleep(0)
            else:
                await answer.add(response)

    def http_body() -> dict:
        return {"choices": [{"index": 0}], "prompt_logprobs": prompt_logprobs_json(logprobs)}

    async def http_answer(on_loop: bool) -> web.Response:
        if on_loop:
            return web.json_response(http_body())
        return await json_answer(http_body, off_loop=True)

    async def ask_pieces(on_loop: bool) -> None:
        """The Ask stream's messages, made and serialized (gRPC's part) as the servicer sends them:
        off the loop, what `prompt_logprobs_pieces_off_loop` gives for what the gateway joined."""
        pieces = convert.prompt_logprobs_pieces(logprobs) if on_loop else None
        if pieces is not None:
            for piece in pieces:
                gateway_pb2.AskResponse(prompt_logprobs=piece).SerializeToString()
                await asyncio.sleep(0)
        else:
            async for piece in convert.prompt_logprobs_pieces_off_loop(logprobs):
                gateway_pb2.AskResponse(prompt_logprobs=piece).SerializeToString()
                await asyncio.sleep(0)

    ask_messages = [
        gateway_pb2.AskResponse(prompt_logprobs=piece).SerializeToString()
        for piece in convert.prompt_logprobs_pieces(logprobs)
    ]

    async def sdk_join(on_loop: bool) -> None:
        """The SDK's join of the Ask stream's pieces into one list, as gRPC hands them over: on the
        loop as the SDK did (`extend` per piece), off it as it does (`_join_prompt_logprobs`)."""
        joined: list[TokenLogprob] = []
        for data in ask_messages:
            piece = gateway_pb2.AskResponse.FromString(data).prompt_logprobs
            if on_loop:
                joined.extend(convert.logprob_from_proto(lp) for lp in piece.logprobs)
                await asyncio.sleep(0)
            else:  # imported here: a commit from before it runs --steps 1,2,3
                from epd.client.client import _join_prompt_logprobs

                await _join_prompt_logprobs(joined, piece)

    print(
        f"{num_tokens} prompt tokens x (k={args.k} + 1) = {num_tokens * (args.k + 1)} entries, "
        f"{len(responses) - 1} pieces; the other stream wakes every {args.token_interval_ms:g} ms"
    )

    async def run() -> None:
        base, _, _ = await largest_gap_s(idle, interval_s)
        print(f"{'nothing else (1 s)':42s} largest gap {base * 1000:7.1f} ms")
        for number, name, step in (
            (1, "1. prefill's pieces joined", join),
            (2, "2. the HTTP answer (JSON built, written)", http_answer),
            (3, "3. the Ask stream's messages made", ask_pieces),
            (4, "4. the SDK joins the Ask stream's pieces", sdk_join),
        ):
            if number not in steps:
                continue
            for on_loop in (True, False):
                gap, seconds, collections = await largest_gap_s(lambda: step(on_loop), interval_s)  # noqa: B023
                where = "on the loop " if on_loop else "off the loop"
                print(
                    f"{name:42s} {where} largest gap {gap * 1000:7.1f} ms (x{gap / base:5.1f}), "
                    f"the step {seconds:5.2f} s, {collections} full GC"
                )

    asyncio.run(run())


if __name__ == "__main__":
    main()
