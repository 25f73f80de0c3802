"""The gateway's early compile of a structured output (`RemotePrefillStage.compile_structured_outputs`)
over real in-process PrefillServices (the real servicer over a stand-in stage: no model): it goes
to the replica the request's prefill goes to, a constraint's refusal comes back as the stage's
error (INVALID_ARGUMENT; RESOURCE_EXHAUSTED marked for retry), and a replica that cannot answer it
(older: UNIMPLEMENTED; still loading: UNAVAILABLE) leaves the compile to the prefill."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc
import pytest

from epd.model_runtime.sampling import ConstraintBusy, InvalidConstraint, StructuredOutputs
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.servicer import PrefillServicer
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.transport.affinity import prefill_key
from epd.transport.errors import UpstreamError
from epd.transport.remote_prefill import RemotePrefillStage
from epd.transport.replica_pool import ReplicaPool
from epd.v1 import prefill_pb2_grpc

GOOD = StructuredOutputs(regex="(red|blue) circle")
BAD = StructuredOutputs(regex="[a-")
BUSY = StructuredOutputs(regex="(yes|no)")


class _Stage:
    """Compiles as a prefill stage's compiler answers: GOOD compiles, BAD does not, BUSY finds too
    many slow compiles running."""

    def __init__(self) -> None:
        self.compiled: list[StructuredOutputs] = []

    async def compile_structured_outputs(self, spec, messages, media, request_id, cache_salt="") -> None:
        if spec == BAD:
            raise InvalidConstraint("the structured-output regex does not compile: Regex parsing error")
        if spec == BUSY:
            raise ConstraintBusy("too many slow structured-output specs are still compiling; retry later")
        self.compiled.append(spec)


async def _serve(servicer: prefill_pb2_grpc.PrefillServiceServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _replica(stage: _Stage | None) -> tuple[grpc.aio.Server, str]:
    servicer = PrefillServicer(PrefillConfig(), KvStore(1 << 20, 60.0))
    servicer.stage = stage  # type: ignore[assignment]  # None: still loading its model
    return await _serve(servicer)


def test_the_spec_compiles_on_the_replica_the_requests_prefill_goes_to():
    messages = question_messages("what is it?")

    async def scenario():
        stages = [_Stage(), _Stage()]
        replicas = [await _replica(stage) for stage in stages]
        addresses = [address for _, address in replicas]
        pool = ReplicaPool(addresses)
        prefill = RemotePrefillStage(pool, 5.0)
        try:
            homes = set()
            for i in range(16):  # media of both replicas' keys
                data = f"video {i}".encode()
                # where `prefill` sends it: the media's sha256 as the encoder answers it
                home = pool.candidates(prefill_key(messages, hashlib.sha256(data).hexdigest(), "t"))[0][0]
                await prefill.compile_structured_outputs(GOOD, messages, MediaInput(data), f"r{i}", "t")
                compiled = [len(stage.compiled) for stage in stages]
                assert compiled[addresses.index(home)] == 1 and sum(compiled) == 1
                for stage in stages:
                    stage.compiled.clear()
                homes.add(home)
            assert homes == set(addresses)
        finally:
            for server, _ in replicas:
                await server.stop(None)
            await pool.close()

    asyncio.run(scenario())


def test_a_constraints_refusal_is_the_stages_error_and_other_failures_leave_it_to_prefill(caplog):
    messages = question_messages("what is it?")
    media = MediaInput(b"video")

    async def scenario():
        server, address = await _replica(_Stage())
        prefill = RemotePrefillStage(ReplicaPool([address]), 5.0)
        try:
            with pytest.raises(UpstreamError, match="regex does not compile") as refused:
                await prefill.compile_structured_outputs(BAD, messages, media, "r1")
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(UpstreamError, match="retry later") as busy:
                await prefill.compile_structured_outputs(BUSY, messages, media, "r2")
            assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and busy.value.retry_after_s
        finally:
            await server.stop(None)
            await prefill.close()
        # A replica older than the call (the generated servicer answers UNIMPLEMENTED), one still
        # loading its model (UNAVAILABLE): logged, and the request goes on.
        for serving in (_serve(prefill_pb2_grpc.PrefillServiceServicer()), _replica(None)):
            server, address = await serving
            prefill = RemotePrefillStage(ReplicaPool([address]), 5.0)
            try:
                with caplog.at_level(logging.WARNING, logger="epd.transport.remote_prefill"):
                    await prefill.compile_structured_outputs(BAD, messages, media, "r3")
            finally:
                await server.stop(None)
                await prefill.close()

    asyncio.run(scenario())
    ahead = [r for r in caplog.records if "could not be compiled ahead" in r.getMessage()]
    assert len(ahead) == 2, [r.getMessage() for r in caplog.records]
