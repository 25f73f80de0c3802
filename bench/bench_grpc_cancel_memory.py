"""What grpc.aio calls cut mid-operation leak, with and without `shield_grpc_batches`; and what
the shield costs a streamed message.

    PYTHONPATH=. .venv/bin/python bench/bench_grpc_cancel_memory.py                 # 20,000 calls a case
    PYTHONPATH=. .venv/bin/python bench/bench_grpc_cancel_memory.py --num-calls 5000 --cases read,unary

What it does, in one run:
  * a raw-bytes grpc.aio server in a child process (so only the client's heap is measured) whose
    handlers answer a little and then hold the call open;
  * per case and setting (grpcio as it is, then shielded), a fresh client process makes
    --num-calls calls of one shape (after a fifth as many to warm up), 200 at a time, each cut the
    way the gateway's calls are cut:
      - "read to end": a streamed answer read to its end (the control: nothing is cut);
      - "read": the task reading a streamed answer is cancelled 30 ms in, mostly while awaiting
        its second message (a client gone while the gateway reads decode's tokens);
      - "call.cancel()": the call is cancelled while its read is in flight, the reading task not;
      - "upload": an upload with a streamed answer (encode's shape), the task making and reading
        the call cancelled 30 ms in, while chunks are still being sent;
      - "upload then answer": an upload with one answer (prefill's shape), cancelled likewise;
      - "unary": a unary call (ReleaseKv's shape) cancelled in flight;
    after the cut, the call itself is cancelled too (a no-op where grpc.aio did; the gateway's
    decode stream does the same);
  * printed: the growth of malloc's bytes in use (mallinfo2) from the first fifth of the calls to
    the last, per call (noise: some 10-30 B a call), and whether any call was left without its
    status (0.3 s after its cut) or any task pending (15 s after the last cut; every call has a
    10 s deadline, as every stage call of the gateway has one);
  * then the CPU a streamed message costs (server write + client read in one process, best of 5
    streams of 20,000 small messages), as it is and shielded.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from epd.transport.aio_cancel import shield_grpc_batches  # noqa: E402
from epd.transport.parent_death import die_with_parent  # noqa: E402

CASES = ["read to end", "read", "call.cancel()", "upload", "upload then answer", "unary"]
CONCURRENCY = 200
CUT_AFTER_S = 0.03
DEADLINE_S = 10.0  # every stage call of the gateway has one; a few cut calls end only at theirs
CHUNK_BYTES = 1024  # small: megabytes of uploads in flight would swamp the bytes a cut call leaks
NUM_STREAMED_MESSAGES = 20_000


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_in_use_bytes() -> int:
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().uordblks)


def raw(message: bytes) -> bytes:
    return message


def serve(port_queue: mp.Queue, parent_pid: int) -> None:
    die_with_parent(parent_pid, 1)  # a bench killed by SIGKILL (no `finally`, no daemon clean-up) ends it too

    async def hold() -> None:
        await asyncio.sleep(3600)

    async def tokens(request: bytes, context):
        yield b"token 0"
        if request == b"to end":
            for _ in range(3):
                yield b"token"
            return
        await hold()

    async def encode(requests, context):
        yield b"event"
        async for _ in requests:
            await asyncio.sleep(0.01)  # a slow reader: the upload is still going when it is cut
        await hold()

    async def prefill(requests, context) -> bytes:
        async for _ in requests:
            await asyncio.sleep(0.01)
        await hold()
        return b""

    async def release(request: bytes, context) -> bytes:
        await hold()
        return b""

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "bench.Cut",
                    {
                        "Tokens": grpc.unary_stream_rpc_method_handler(tokens, raw, raw),
                        "Encode": grpc.stream_stream_rpc_method_handler(encode, raw, raw),
                        "Prefill": grpc.stream_unary_rpc_method_handler(prefill, raw, raw),
                        "Release": grpc.unary_unary_rpc_method_handler(release, raw, raw),
                    },
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


async def upload():
    for _ in range(8):
        yield b"\0" * CHUNK_BYTES


async def cut_one(channel: grpc.aio.Channel, case: str, calls: list, failed: list) -> None:
    """One call of `case`, made and read by the task that is cut (as a gateway request's task)."""

    def method(kind: str, name: str):
        return getattr(channel, kind)(f"/bench.Cut/{name}", request_serializer=raw, response_deserializer=raw)

    mine: list[grpc.aio.Call] = []  # this cut's call (none if cut before it was made)

    async def body() -> None:
        if case in ("read to end", "read", "call.cancel()"):
            call = method("unary_stream", "Tokens")(
                b"to end" if case == "read to end" else b"hold", timeout=DEADLINE_S
            )
            calls.append(call)
            mine.append(call)
            if case == "read to end":
                async for _ in call:
                    pass
                return
            await call.read()
            if case == "call.cancel()":
                asyncio.get_running_loop().call_later(CUT_AFTER_S, call.cancel)
                try:
                    await call.read()
                except asyncio.CancelledError:
                    pass
                return
            await call.read()  # cut in flight
        elif case == "upload":
            call = method("stream_stream", "Encode")(upload(), timeout=DEADLINE_S)
            calls.append(call)
            mine.append(call)
            async for _ in call:
                pass
        elif case == "upload then answer":
            call = method("stream_unary", "Prefill")(upload(), timeout=DEADLINE_S)
            calls.append(call)
            mine.append(call)
            await call
        else:
            call = method("unary_unary", "Release")(b"hold", timeout=DEADLINE_S)
            calls.append(call)
            mine.append(call)
            await call

    try:
        if case in ("read to end", "call.cancel()"):
            await body()
        else:
            await asyncio.wait_for(body(), CUT_AFTER_S)
    except asyncio.TimeoutError:
        pass
    except grpc.aio.AioRpcError as exc:  # the loaded server's (seen: a rare CANCELLED); counted
        failed.append(exc.code())
    for call in mine:
        # As the gateway's decode stream does in its `finally`: a cut that lands just as the call's
        # start completes can leave grpc.aio's call running on (to its deadline) uncancelled.
        call.cancel()


async def measure(case: str, num_calls: int, port: int) -> str:
    calls: list[grpc.aio.Call] = []
    failed: list[grpc.StatusCode] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

        async def some(n: int) -> int:
            for start in range(0, n, CONCURRENCY):
                await asyncio.gather(
                    *(cut_one(channel, case, calls, failed) for _ in range(min(CONCURRENCY, n - start)))
                )
            await asyncio.sleep(0.3)
            num_without_status = sum(not call.done() for call in calls)
            calls.clear()
            return num_without_status

        fifth = num_calls // 5
        await some(fifth)  # warm-up: gRPC's and malloc's own caches reach their working size
        in_use = []
        num_without_status = 0
        for _ in range(5):
            num_without_status += await some(fifth)
            in_use.append(malloc_in_use_bytes())
        # Batches the cuts left run on until gRPC completes them (shielded): at the latest when their
        # call's deadline passes.
        give_up_at = time.monotonic() + DEADLINE_S + 5
        while len(asyncio.all_tasks()) > 1 and time.monotonic() < give_up_at:
            await asyncio.sleep(0.1)
        num_pending = len(asyncio.all_tasks()) - 1
    per_call = (in_use[-1] - in_use[0]) / (4 * fifth)
    return (
        f"{per_call:6.0f} B/call   calls without status: {num_without_status}   tasks pending: {num_pending}"
        f"   calls failed: {len(failed)}"
    )


def client_main(case: str, shielded: bool, num_calls: int, port: int) -> None:
    if shielded:
        shield_grpc_batches()
    print(asyncio.run(measure(case, num_calls, port)), flush=True)


def streamed_message_cpu_us(shielded: bool) -> float:
    if shielded:
        shield_grpc_batches()

    async def stream(request: bytes, context):
        for _ in range(NUM_STREAMED_MESSAGES):
            yield b"t" * 16

    async def main() -> float:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "bench.Stream", {"Tokens": grpc.unary_stream_rpc_method_handler(stream, raw, raw)}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        best_s = float("inf")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            tokens = channel.unary_stream(
                "/bench.Stream/Tokens", request_serializer=raw, response_deserializer=raw
            )
            for _ in range(5):
                started = time.process_time()
                async for _ in tokens(b""):
                    pass
                best_s = min(best_s, time.process_time() - started)
        await server.stop(None)
        return best_s / NUM_STREAMED_MESSAGES * 1e6

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-calls", type=int, default=20_000, help="calls a case and setting")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--client", nargs=3, metavar=("CASE", "SHIELDED", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--stream-cpu", choices=["0", "1"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:  # one measurement, in a fresh process
        case, shielded, port = args.client
        client_main(case, shielded == "1", args.num_calls, int(port))
        return
    if args.stream_cpu:
        print(f"{streamed_message_cpu_us(args.stream_cpu == '1'):.1f}", flush=True)
        return

    print(
        f"grpcio {grpc.__version__}, Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.1f}; {args.num_calls} calls a case"
    )
    port_queue: mp.Queue = mp.Queue()
    server = mp.get_context("fork").Process(target=serve, args=(port_queue, os.getpid()), daemon=True)
    server.start()
    port = port_queue.get()
    try:
        for case in args.cases.split(","):
            for shielded in (False, True):
                client = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--num-calls",
                        str(args.num_calls),
                        "--client",
                        case,
                        "1" if shielded else "0",
                        str(port),
                    ],
                    capture_output=True,
                    text=True,
                )
                out = (
                    (client.stdout.strip().splitlines() or [""])[-1]
                    if client.returncode == 0
                    else ("failed: " + (client.stderr.strip().splitlines() or ["?"])[-1])
                )
                print(f"{case:>20} {'shielded' if shielded else 'as it is':>9}: {out}", flush=True)
    finally:
        server.kill()
    for shielded in (False, True):
        cpu_us = [
            float(
                subprocess.run(
                    [sys.executable, __file__, "--stream-cpu", "1" if shielded else "0"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
            )
            for _ in range(3)
        ]
        print(
            f"streamed message, {'shielded' if shielded else 'as it is'}: "
            f"{min(cpu_us):.1f} us CPU (best of 3 runs: {', '.join(f'{u:.1f}' for u in cpu_us)})",
            flush=True,
        )


if __name__ == "__main__":
    main()
