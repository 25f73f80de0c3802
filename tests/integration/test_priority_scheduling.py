"""vLLM's priority scheduling through real processes: with `--scheduling-policy priority` on every
stage, a high-priority request that arrives behind low-priority ones waiting for the decoder is
served before them (ties in arrival order), and the running low-priority request is not preempted
for it; with the default fcfs, a non-zero priority is refused (HTTP 400 on chat and completions,
INVALID_ARGUMENT on gRPC) with a message that names the flag, as vLLM's."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd.client import AsyncEpdClient, EpdClient
from epd.client.types import EpdError, TokenDelta
from tests.local_http import post_json
from tests.stack import Stack

QUESTION = "what colour is the square?"
WAIT_S = 120.0  # a deadline for a state to be reached on two busy cores, not a timing assertion


def _decode_waiting(http_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "epd_engine_waiting_requests" and sample.labels["stage"] == "decode"
    )


async def _until_decode_waiting(http_port: int, count: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while (waiting := await asyncio.to_thread(_decode_waiting, http_port)) < count:
        assert time.monotonic() < deadline, f"{waiting} requests waited for the decoder, not {count}"
        await asyncio.sleep(0.05)


def test_a_high_priority_request_queued_behind_low_priority_ones_is_served_first(
    tiny_models, tmp_path_factory
):
    """Decode has one slot (--max-running-requests 1), held by a long low-priority answer. Two
    low-priority requests, then a high-priority one, are prefilled and wait for the slot (the
    decoder's waiting gauge says so, one at a time, so their arrival order is known). The long
    answer is still decoding then: not preempted. When it ends (its client leaves), the slot goes
    to the high-priority request, then to the low ones in arrival order: they finish in that order.
    Under fcfs they would finish low1, low2, high."""
    policy = ["--scheduling-policy", "priority"]
    extra = {
        "encoder": policy,
        "prefill": policy,
        "decode": [*policy, "--max-running-requests", "1"],
    }
    finished: list[str] = []
    with Stack(
        tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_priority"), extra=extra, http=True
    ) as stack:

        async def answer(client: AsyncEpdClient, name: str, priority: int) -> None:
            result = await client.ask(None, QUESTION, max_new_tokens=4, priority=priority)
            assert len(result.token_ids) == 4
            finished.append(name)

        async def run() -> None:
            async with AsyncEpdClient(stack.gateway) as client:
                decoding = asyncio.Event()

                async def long_answer() -> None:
                    num_tokens = 0
                    stream = client.stream(None, QUESTION, max_new_tokens=4096, ignore_eos=True, priority=10)
                    async for event in stream:
                        if isinstance(event, TokenDelta):
                            num_tokens += len(event.token_ids)
                            if num_tokens >= 2:  # the first is prefill's: the decoder holds it now
                                decoding.set()

                holder = asyncio.create_task(long_answer())
                started = asyncio.create_task(decoding.wait())
                await asyncio.wait([holder, started], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
                if holder.done():
                    holder.result()  # its error
                assert started.done(), "the long answer never reached the decoder"
                waiters = []
                for i, (name, priority) in enumerate((("low1", 10), ("low2", 10), ("high", -10))):
                    waiters.append(asyncio.create_task(answer(client, name, priority)))
                    await _until_decode_waiting(stack.http_port, i + 1)
                assert not holder.done(), "the long answer still decodes: a waiting request preempts nothing"
                holder.cancel()  # its client leaves: its room is freed and the slot given to the first waiting
                await asyncio.gather(holder, return_exceptions=True)
                await asyncio.wait_for(asyncio.gather(*waiters), WAIT_S)

        asyncio.run(run())
        assert finished == ["high", "low1", "low2"]
        assert stack.alive()


def test_fcfs_refuses_a_nonzero_priority_with_a_400_naming_the_flag(shared_stack):
    chat = {"model": "epd", "max_tokens": 2, "messages": [{"role": "user", "content": QUESTION}]}
    completion = {"model": "epd", "max_tokens": 2, "prompt": QUESTION}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        status, answer = post_json(shared_stack.http_port, path, {**body, "priority": 1})
        assert status == 400, (path, answer)
        assert "--scheduling-policy priority" in answer["error"]["message"]
        status, answer = post_json(shared_stack.http_port, path, {**body, "priority": 0})
        assert status == 200, (path, answer)
    with EpdClient(shared_stack.gateway) as client:
        with pytest.raises(EpdError) as info:
            client.ask(None, QUESTION, max_new_tokens=2, priority=-1)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "--scheduling-policy priority" in info.value.message


def test_epd_ask_sends_its_priority_to_an_endpoint_and_takes_it_embedded(shared_stack, tiny_models, capsys):
    """`epd ask --priority N`: against --endpoint it is the request's priority (the fcfs stack
    refuses a non-zero one naming the flag, so it was sent; 0 is taken); embedded, the stages take
    it as a server started with --scheduling-policy priority does and answer."""
    from epd.cli.main import main

    ask = ["ask", "--no-video", QUESTION, "--max-new-tokens", "2", "--json"]
    assert main([*ask, "--endpoint", shared_stack.gateway, "--priority", "1"]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT" in err and "--scheduling-policy priority" in err, err
    assert main([*ask, "--endpoint", shared_stack.gateway, "--priority", "0"]) == 0
    capsys.readouterr()
    assert main([*ask, "--model", str(tiny_models["qwen2_vl"]), "--priority", "-3"]) == 0
    out = capsys.readouterr().out
    assert len(json.loads(out.strip().splitlines()[-1])["token_ids"]) == 2, out
