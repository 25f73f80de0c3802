"""The decode stage over gRPC: the answer's tokens streamed from a decode replica that
`ReplicaPool` picks.

A decode stream that fails the ways an encode or prefill try is retried on (`ReplicaPool.call`)
before its first token is retried the same way (the new replica pulls the KV cache from prefill
again; if that cache is gone the retry fails and says so). After the first token nothing is
retried: the client has part of an answer, and gets ABORTED saying so
(`epd.transport.errors.broken_stream`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import DecodeStage, PrefillHandle, TokenStep
from epd.stages.deadline import timeout_within_client_deadline
from epd.stages.errors import InvalidRequest, KvSourceLost
from epd.token_pruning import PruningConfig
from epd.transport import convert
from epd.transport.aio_cancel import within
from epd.transport.errors import (
    UpstreamError,
    broken_stream,
    failed_after_retry,
    replica_lost,
    retry_after_of,
    stage_error,
)
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

BROKEN_STREAM_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.CANCELLED,
    }
)
"""How a decode replica that died (or was stopped) mid-answer ends its stream; after the first token
these become ABORTED (`broken_stream`): the answer is incomplete and only the whole request can be
retried. Other codes (the deadline, the request's own errors) pass on as they are."""


class RemoteDecodeStage(DecodeStage):
    def __init__(self, pool: ReplicaPool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    async def close(self) -> None:
        """Close the pool's channels (idempotent); the stage takes no call after it."""
        await self.pool.close()

    async def generate(
        self,
        handle: PrefillHandle,
        generation: GenerationConfig,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> AsyncIterator[TokenStep]:
        """Tokens from the least loaded decode replica. One that fails (UNAVAILABLE) or hangs past
        the pool's attempt timeout before its first token is left for the next healthy replica,
        each at most once within `timeout_s` and the time the request's client has left
        (`epd.stages.deadline`); after the first token a failure is ABORTED. One that
        is full (RESOURCE_EXHAUSTED marked busy) is left for the next replica too; when the last
        is full as well, that busy error is raised (the pipeline waits for room)."""
        if not handle.kv_address:
            raise InvalidRequest("a remote decoder needs the prefill server's kv_address")
        request = decode_pb2.GenerateRequest(
            request_id=request_id,
            prefill=convert.handle_to_proto(handle),
            generation=convert.generation_to_proto(generation),
            pruning=convert.pruning_to_proto(pruning),
        )
        end_at = time.monotonic() + timeout_within_client_deadline(self.timeout_s)
        tries = self.pool.candidates()
        if not tries:
            raise self.pool.nothing_to_call("decode", request_id)
        failed: list[str] = []  # "ADDRESS: what happened", for the log and the last error
        while tries:
            (address, channel), tries = tries[0], self.pool.still_listed(tries[1:])
            remaining = end_at - time.monotonic()
            first_timeout_s = self.pool.try_timeout_s(remaining)
            call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=remaining)
            num_tokens = 0
            self.pool.begin(address)
            try:
                stream = call.__aiter__()
                try:
                    first = await within(stream.__anext__(), first_timeout_s)  # keeps a cancel
                except asyncio.TimeoutError:
                    if first_timeout_s >= remaining:  # the call's own deadline, not a hang
                        raise UpstreamError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"decode stage did not answer in time (request id {request_id})",
                        ) from None
                    self.pool.mark_failed(address, hung=True)
                    failed.append(f"{address}: no first token in {first_timeout_s:.1f} s")
                    tries = self.pool.still_listed(tries)  # the list may have changed during the try
                    if not tries:
                        raise UpstreamError(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"decode stage did not answer in time (request id {request_id})",
                        ) from None
                    log.warning(
                        "decode replica %s gave no first token in %.1f s for request %s; trying %s",
                        address,
                        first_timeout_s,
                        request_id,
                        tries[0][0],
                    )
                    continue
                except StopAsyncIteration:
                    return
                step = convert.token_step_from_proto(first)
                num_tokens += len(step.token_ids)
                yield step
                async for msg in stream:
                    step = convert.token_step_from_proto(msg)
                    num_tokens += len(step.token_ids)
                    yield step
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if num_tokens or not replica_lost(exc):
                    if num_tokens and code in BROKEN_STREAM_CODES:
                        log.warning(
                            "request %s: decode replica %s failed after %d tokens: %s %s",
                            request_id,
                            address,
                            num_tokens,
                            code.name,
                            exc.details(),
                        )
                        raise broken_stream("decode", num_tokens, request_id) from None
                    if not num_tokens and code == grpc.StatusCode.ABORTED:  # its prefill replica is gone
                        raise KvSourceLost(exc.details() or "the request's KV cache was lost") from None
                    tries = self.pool.still_listed(tries)
                    if not num_tokens and retry_after_of(exc) is not None and tries:
                        # Full (`Busy`, its KV memory and wait queue): it took nothing, pulled no
                        # cache and stays healthy; a sibling may have room.
                        log.info(
                            "decode replica %s is full for request %s; trying %s",
                            address,
                            request_id,
                            tries[0][0],
                        )
                        continue
                    if failed:
                        log.warning(
                            "request %s: decode retried after %s; then %s: %s %s",
                            request_id,
                            "; ".join(failed),
                            address,
                            code.name,
                            exc.details(),
                        )
                        raise failed_after_retry(stage_error(exc, "decode", request_id), "decode") from None
                    raise stage_error(exc, "decode", request_id) from None
                self.pool.mark_failed(address)
                failed.append(f"{address}: unavailable ({exc.details()})")
                tries = self.pool.still_listed(tries)
                if not tries or end_at - time.monotonic() <= 0:
                    raise stage_error(exc, "decode", request_id) from None
                log.warning(
                    "decode replica %s unavailable before the first token of request %s (%s); trying %s",
                    address,
                    request_id,
                    exc.details(),
                    tries[0][0],
                )
            finally:
                call.cancel()  # no-op once it ended; stops the replica when the consumer went away
                self.pool.end(address)
