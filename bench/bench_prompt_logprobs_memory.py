"""What the request with the most prompt logprobs holds at the gateway: MAX_PROMPT_LOGPROB_ENTRIES
entries (prompt tokens x (k + 1)), received in pieces from prefill and answered over HTTP.

    PYTHONPATH=. python bench/bench_prompt_logprobs_memory.py
    PYTHONPATH=. python bench/bench_prompt_logprobs_memory.py --k 5 --token-chars 4

No model and no servers: the gateway's own steps on a list made up at the bound (ids in Qwen2-VL's
151,936-token vocabulary, token texts of `--token-chars` characters, BPE's usual length), each
measured by tracemalloc (Python's allocations; the peak is above what the step started with) and
by the resident memory its result added (protobuf's messages live in arenas tracemalloc does not see):
1. prefill's answer as the gateway reads it: the pieces (`prefill_responses`, serialized as on the
   wire) joined by `PrefillAnswer`, what it then holds (the pieces' messages) and its peak;
2. the HTTP answer, as `json_answer` writes it: vLLM's JSON of them (`prompt_logprobs_json`)
   and its bytes (`json_bytes`), both held at once at the end;
3. the Ask stream's messages to the SDK, as the servicer makes them (`prompt_logprobs_pieces_off_loop`
   on what was joined): one at a time;
4. the SDK's `AskResult.prompt_logprobs`, joined from those messages as the SDK joins them.
The times are each step's without tracemalloc, on this machine.

    PYTHONPATH=. python bench/bench_prompt_logprobs_memory.py --steps 1,2,3   (a commit before step 4)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from epd.gateway.json_answer import json_bytes  # noqa: E402
from epd.gateway.logprobs_protocol import prompt_logprobs_json  # noqa: E402
from epd.model_runtime.logprobs import MAX_PROMPT_LOGPROB_ENTRIES, TokenLogprob, TopLogprob  # noqa: E402
from epd.stages.contracts import PrefillHandle, TensorLike  # noqa: E402
from epd.transport import convert  # noqa: E402
from epd.v1 import gateway_pb2, prefill_pb2  # noqa: E402

QWEN_VOCAB = 151_936


def made_up(num_tokens: int, k: int, token_chars: int) -> list[TokenLogprob]:
    rng = random.Random(0)

    def text() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(token_chars))

    def top() -> tuple[TopLogprob, ...]:
        return tuple(TopLogprob(rng.randrange(QWEN_VOCAB), text(), -rng.random() * 20) for _ in range(k))

    return [
        TokenLogprob(
            rng.randrange(QWEN_VOCAB), text(), -rng.random() * 20, top(), rng.randrange(1, QWEN_VOCAB)
        )
        for _ in range(num_tokens)
    ]


def at_the_bound(k: int, token_chars: int) -> tuple[PrefillHandle, list[bytes]]:
    """Prefill's handle with the most prompt logprobs at this k, and its answer's messages as
    serialized on the wire (`prefill_responses`)."""
    num_tokens = MAX_PROMPT_LOGPROB_ENTRIES // (k + 1)
    handle: PrefillHandle[TensorLike] = PrefillHandle(
        first_token_id=1, num_prompt_tokens=num_tokens, num_cached_tokens=num_tokens,
        next_position_ids=[num_tokens] * 4, kv_num_bytes=0, prefill_ms=0.0, kv_handle="ab" * 16,
        prompt_logprobs=made_up(num_tokens, k, token_chars),
    )  # fmt: skip

    async def responses() -> list[bytes]:
        return [r.SerializeToString() async for r in convert.prefill_responses(handle)]

    return handle, asyncio.run(responses())


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(step: Callable[[], Any]) -> tuple[Any, int, int, float, int]:
    """(its result, bytes it still holds, its peak above the start, seconds without tracing, the
    resident memory its result added: protobuf's arenas, which tracemalloc does not see)."""
    gc.collect()
    resident = resident_bytes()
    started = time.perf_counter()
    kept = step()
    seconds = time.perf_counter() - started
    gc.collect()
    resident = resident_bytes() - resident
    del kept
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    result = step()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, held - base, peak - base, seconds, resident


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--k", type=int, default=20, help="top tokens a position (vLLM's most by default)")
    parser.add_argument("--token-chars", type=int, default=6, help="characters of each token's text")
    parser.add_argument(
        "--steps", default="1,2,3,4", help="which steps to run (a commit before step 4 has none)"
    )
    args = parser.parse_args()
    steps = {int(step) for step in args.steps.split(",")}
    handle, wire = at_the_bound(args.k, args.token_chars)
    num_tokens = handle.num_prompt_tokens
    del handle  # the made-up list: 2 and 3 read what the gateway joined (`logprobs`)
    num_entries = num_tokens * (args.k + 1)
    print(
        f"{num_tokens} prompt tokens x (k={args.k} + 1) = {num_entries} entries (MAX_PROMPT_LOGPROB_ENTRIES "
        f"{MAX_PROMPT_LOGPROB_ENTRIES}), token texts of {args.token_chars} characters; on the wire "
        f"{sum(map(len, wire)) / 2**20:.1f} MiB in {len(wire) - 1} pieces of at most "
        f"{max(map(len, wire[:-1])) / 2**20:.2f} MiB"
    )

    async def read() -> Sequence[TokenLogprob]:
        answer = convert.PrefillAnswer()
        for data in wire:
            await answer.add(prefill_pb2.PrefillResponse.FromString(data))
        return answer.handle(relay=True).prompt_logprobs or []

    def receive() -> Sequence[TokenLogprob]:
        return asyncio.run(read())

    logprobs = receive()

    def http_answer() -> tuple:
        body = {"choices": [{"prompt_logprobs": prompt_logprobs_json(logprobs)}]}
        return body, json_bytes(body)

    async def ask_messages_one_at_a_time() -> AsyncIterator[bytes]:
        async for piece in convert.prompt_logprobs_pieces_off_loop(logprobs):
            yield gateway_pb2.AskResponse(prompt_logprobs=piece).SerializeToString()

    async def ask_messages() -> list[bytes]:
        return [data async for data in ask_messages_one_at_a_time()]

    def ask_pieces() -> int:
        """The largest message: one is held at a time (the servicer's, then gRPC's bytes)."""

        async def largest() -> int:
            sizes = [len(data) async for data in ask_messages_one_at_a_time()]
            return max(sizes)

        return asyncio.run(largest())

    messages = asyncio.run(ask_messages()) if 4 in steps else []

    def sdk_join() -> list[TokenLogprob]:
        # imported here: a commit from before it runs --steps 1,2,3
        from epd.client.client import _join_prompt_logprobs

        async def join() -> list[TokenLogprob]:
            joined: list[TokenLogprob] = []
            for data in messages:
                await _join_prompt_logprobs(joined, gateway_pb2.AskResponse.FromString(data).prompt_logprobs)
            return joined

        return asyncio.run(join())

    mib = 2**20
    for number, name, step in (
        (1, "1. prefill's pieces joined at the gateway", receive),
        (2, "2. the HTTP answer (JSON and its bytes)", http_answer),
        (3, "3. the Ask stream's messages to the SDK", ask_pieces),
        (4, "4. the SDK's AskResult.prompt_logprobs", sdk_join),
    ):
        if number not in steps:
            continue
        _, held, peak, seconds, resident = measured(step)
        print(
            f"{name:45s} holds {held / mib:7.1f} MiB ({held / num_entries:5.0f} B an entry), "
            f"peak {peak / mib:7.1f} MiB, {seconds:6.2f} s"
            # what the others free of earlier steps' makes their resident memory's change meaningless
            + (f"; resident {resident / mib:+.1f} MiB" if step in (receive, sdk_join) else "")
        )


if __name__ == "__main__":
    main()
