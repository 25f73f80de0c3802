"""The client's gRPC deadline reaches prefill with the gateway's calls (`epd.stages.deadline`), real
processes on loopback.

A client asks through the gateway with a deadline of a few seconds, far under the gateway's stage
timeout (600 s), a prompt whose chat template (the request's own, --trust-request-chat-template)
renders for longer than that deadline. Once prefill has the call, the gateway is stopped (SIGSTOP:
a stalled gateway, whose cancel cannot reach prefill, as a cancel lost while a call starts). The
client gets DEADLINE_EXCEEDED, and prefill ends the call by itself at the client's deadline: its
log ends the RPC unanswered, the render stops at its next step, and nothing is kept (no KV cache,
no queue place). Before, prefill had only the stage timeout: it rendered the prompt to its end,
prefilled it and stored its cache for a gateway that could not take it.

The Tokenize path (`GatewayService.Tokenize` -> `PrefillService.Tokenize`) and the Ask path
(`Ask` -> `Prefill`). Waits poll with a deadline only so that a broken build fails instead of
hanging; nothing is timed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import grpc
import pytest

from epd.client import AsyncEpdClient, EpdError, StageEvent
from epd.transport.load import fetch_loads
from epd.v1 import prefill_pb2, prefill_pb2_grpc
from tests.stack import Stack, VerboseStack, wait_until

CLIENT_DEADLINE_S = 2.0
"""The client's deadline: far under the gateway's stage timeout (GatewayConfig.stage_timeout_s, 600 s), and under the slow
template's render (about 10 s of Jinja loop on this machine's CPU)."""
WAIT_S = 120.0

SLOW_TEMPLATE = (
    # 1.2 million steps of the template's own loop (an empty loop costs jinja next to nothing)
    "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(12) %}"
    "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content[-1].text }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [{"role": "user", "content": [{"type": "text", "text": "what colour is the circle?"}]}]


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    extra = {"prefill": ["--trust-request-chat-template"]}
    with VerboseStack(tiny_models["qwen2_vl"], tmp_path_factory.mktemp("logs_deadline"), extra=extra) as s:
        yield s


def _prefill_lines(stack: Stack, request_id: str) -> list[str]:
    """Prefill's log lines about `request_id` (each ends ` request_id=ID`)."""
    lines = (stack.log_dir / "prefill.log").read_text().splitlines()
    return [line for line in lines if line.endswith(f" request_id={request_id}")]


def _rpc_codes(stack: Stack, method: str, request_id: str) -> list[str]:
    """The status of each `method` call prefill ended for `request_id` (its `rpc ... CODE` line)."""
    marker = f"rpc /epd.v1.PrefillService/{method} "
    return [line.split(marker)[1].split()[0] for line in _prefill_lines(stack, request_id) if marker in line]


def _prefill_holds(stack: Stack) -> tuple[int, int, int]:
    """(KV caches stored, prompts running, prompts waiting) at prefill, read from prefill itself."""
    with grpc.insecure_channel(stack.address("prefill")) as channel:
        held = prefill_pb2_grpc.PrefillServiceStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(kv_handle="no-such-handle"), timeout=30
        )

    async def load():
        async with grpc.aio.insecure_channel(stack.address("prefill")) as channel:
            return (await fetch_loads(channel, 30))[0]

    core = asyncio.run(load())
    return held.num_kv_caches_held, core.num_running, core.num_waiting


@pytest.mark.parametrize("method", ["Tokenize", "Prefill"])
def test_prefill_ends_a_call_at_its_clients_deadline_when_the_gateway_stalls(stack, method):
    request_id = f"late-{method.lower()}"
    gateway_pid = stack.procs["gateway"].pid

    async def scenario() -> EpdError:
        async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S) as client:
            options = dict(chat_template=SLOW_TEMPLATE, request_id=request_id, timeout_s=CLIENT_DEADLINE_S)
            if method == "Tokenize":
                late = asyncio.ensure_future(client.tokenize(messages=CONVERSATION, **options))
            else:
                prefilling = asyncio.Event()

                async def ask() -> None:
                    async for item in client.stream(None, messages=CONVERSATION, max_new_tokens=2, **options):
                        if isinstance(item, StageEvent) and (item.stage, item.state) == (
                            "prefill",
                            "started",
                        ):
                            prefilling.set()

                late = asyncio.ensure_future(ask())
                waiting = asyncio.ensure_future(prefilling.wait())
                await asyncio.wait([late, waiting], timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                assert prefilling.is_set(), late.exception() if late.done() else "no prefill started event"
            # The gateway has sent the late call on to prefill: a call sent after it through the
            # same gateway (on the same connections) is answered.
            await client.tokenize("a probe", timeout_s=WAIT_S)
            assert not late.done(), "the late call ended before the gateway stalled"
            os.kill(gateway_pid, signal.SIGSTOP)
            try:
                with pytest.raises(EpdError) as err:
                    await late
                await asyncio.to_thread(
                    wait_until, lambda: _rpc_codes(stack, method, request_id), f"prefill ending {request_id}"
                )
                # The render runs its template to its end (a thread cannot be stopped), then stops.
                await asyncio.to_thread(
                    wait_until,
                    lambda: any(
                        "stopped between its steps" in line for line in _prefill_lines(stack, request_id)
                    ),
                    f"the render of {request_id} stopping",
                )
            finally:
                os.kill(gateway_pid, signal.SIGCONT)
            return err.value

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # Ended by prefill at the client's deadline while the gateway was stopped: not answered.
    assert _rpc_codes(stack, method, request_id) in (["CANCELLED"], ["DEADLINE_EXCEEDED"])
    if method == "Prefill":
        assert any("no KV cache is kept" in line for line in _prefill_lines(stack, request_id))
    assert _prefill_holds(stack) == (0, 0, 0)
    # The gateway, going on, serves the next request.
    with_deadline = asyncio.run(_tokenize_after(stack))
    assert with_deadline.token_ids


async def _tokenize_after(stack: Stack):
    async with AsyncEpdClient(stack.gateway, timeout_s=WAIT_S) as client:
        return await client.tokenize(messages=CONVERSATION, timeout_s=WAIT_S)


EMBEDDED_DEADLINE_S = 0.5
"""The embedded request's client deadline: far under the slow template's render."""


def test_an_embedded_pipelines_prefill_refuses_the_render_at_its_clients_deadline(tiny_models, caplog):
    """In embedded mode (`build_embedded_pipeline`: `epd serve --colocate`'s gateway, `epd ask`
    without --endpoint) the local prefill reads the client deadline of the request's task
    (`epd.stages.deadline`, which the gateway's gRPC front door sets as here), as a prefill service
    reads its gRPC call's: the slow render stops at its next step once the deadline passed (or is
    refused unrendered, on a machine busy enough that the deadline passed before it started), and
    the request ends DEADLINE_EXCEEDED, nothing prefilled nor decoded. Before, the local stages
    had no deadline: the render ran, and the prompt was prefilled and answered for a client long
    gone."""
    from epd.gateway.ask_types import AskRequest
    from epd.gateway.embedded import build_embedded_pipeline
    from epd.model_runtime.config import ModelConfig
    from epd.model_runtime.sampling import GenerationConfig
    from epd.prefill_svc.config import PrefillConfig
    from epd.stages.deadline import set_client_deadline
    from epd.stages.errors import DeadlineExceeded
    from epd.stages.messages import ChatTemplateOptions, from_chat_template
    from epd.transport.errors import status_of
    from tests.embedded import request_summary

    model = ModelConfig(model=str(tiny_models["qwen2_vl"]))
    request = AskRequest(
        from_chat_template(CONVERSATION),
        generation=GenerationConfig(max_new_tokens=2),
        template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
        request_id="late-embedded",
    )

    async def ask():  # in a task of its own, as the gateway's handler
        set_client_deadline(EMBEDDED_DEADLINE_S)
        return await request_summary(pipeline, request)

    prefill = PrefillConfig(model=model, trust_request_chat_template=True)
    with build_embedded_pipeline(model, prefill=prefill) as pipeline:
        with caplog.at_level(logging.INFO, logger="epd.prefill_svc.stage"):
            with pytest.raises(DeadlineExceeded) as refused:
                asyncio.run(asyncio.wait_for(ask(), WAIT_S))
    assert status_of(refused.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    renders = [
        r.getMessage() for r in caplog.records if "the render of request late-embedded" in r.getMessage()
    ]
    assert len(renders) == 1 and "its call's deadline passed" in renders[0], renders
