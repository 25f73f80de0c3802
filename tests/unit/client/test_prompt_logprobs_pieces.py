"""The SDK joins the prompt's logprobs from the `AskResponse.prompt_logprobs` pieces that come
before the first token into `AskResult.prompt_logprobs`, each piece's entries made on a worker
thread, off the client's event loop; a call retried after UNAVAILABLE (before its first token,
after some pieces) starts the list over, so no token is there twice. The server is a bare
GatewayService on loopback answering what the real one sends, in pieces of the real size."""

from __future__ import annotations

import asyncio
import threading

import grpc

from epd.client import AsyncEpdClient
from epd.client import client as client_module
from epd.client.retry import RetryPolicy
from epd.model_runtime.logprobs import TokenLogprob, TopLogprob
from epd.transport.message_convert import logprob_from_proto, prompt_logprobs_pieces
from epd.v1 import gateway_pb2, gateway_pb2_grpc

NUM_PROMPT_TOKENS = 3000
PIECE_BYTES = 16 << 10  # small pieces, so that the list comes in many


def _prompt_logprobs() -> list[TokenLogprob]:
    top = (TopLogprob(11, "x", -0.5), TopLogprob(12, "y", -1.5))
    return [TokenLogprob(i, f"t{i}", -1.0 - i, top, rank=1 + i % 7) for i in range(NUM_PROMPT_TOKENS)]


class LosesItsFirstCall(gateway_pb2_grpc.GatewayServiceServicer):
    """The first call sends half the pieces, then ends UNAVAILABLE (a lost replica); the next
    sends them all, a token and the summary."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def Ask(self, request_iterator, context):  # noqa: N802 - gRPC's name
        self.num_calls += 1
        async for _ in request_iterator:
            pass
        pieces = list(prompt_logprobs_pieces(_prompt_logprobs(), PIECE_BYTES))
        if self.num_calls == 1:
            for piece in pieces[: len(pieces) // 2]:
                yield gateway_pb2.AskResponse(prompt_logprobs=piece)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the prefill replica went away")
        for piece in pieces:
            yield gateway_pb2.AskResponse(prompt_logprobs=piece)
        yield gateway_pb2.AskResponse(delta=gateway_pb2.TokenDelta(token_ids=[5], text="a"))
        yield gateway_pb2.AskResponse(
            summary=gateway_pb2.AskSummary(
                answer="a", token_ids=[5], finish_reason="length", num_prompt_tokens=NUM_PROMPT_TOKENS
            )
        )


def test_the_pieces_join_into_the_result_and_a_retried_call_starts_them_over(monkeypatch):
    """The result's list is made as the pieces come, each piece's entries on a worker thread: on
    the client's event loop, 0.3 s a piece of the largest list stalled every other call's stream."""
    servicer = LosesItsFirstCall()
    made_on: set[int] = set()

    def noted(msg):
        made_on.add(threading.get_ident())
        return logprob_from_proto(msg)

    monkeypatch.setattr(client_module, "logprob_from_proto", noted)

    async def run():
        server = grpc.aio.server()
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            retry = RetryPolicy(max_attempts=2, initial_backoff_s=0.01)
            async with AsyncEpdClient(f"127.0.0.1:{port}", retry=retry) as client:
                return await client.ask(None, "q?", prompt_logprobs=2), threading.get_ident()
        finally:
            await server.stop(0)

    result, loop_thread = asyncio.run(run())
    assert made_on and loop_thread not in made_on
    assert type(result.prompt_logprobs) is list  # the SDK's documented type
    assert servicer.num_calls == 2 and result.num_attempts == 2
    assert len(list(prompt_logprobs_pieces(_prompt_logprobs(), PIECE_BYTES))) > 2
    assert result.prompt_logprobs == _prompt_logprobs()
