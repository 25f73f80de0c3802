"""Engine load over the wire: `EngineLoad` <-> `epd.v1.EngineLoad`, and the gateway's read of a
service's load (`fetch_loads`). The service side is `epd.transport.load_servicer`."""

from __future__ import annotations

import dataclasses

import grpc

from epd.stages.engine_core import EngineLoad
from epd.v1 import load_pb2, load_pb2_grpc

_FIELDS = [f.name for f in dataclasses.fields(EngineLoad)]


def load_to_proto(load: EngineLoad) -> load_pb2.EngineLoad:
    return load_pb2.EngineLoad(**{name: getattr(load, name) for name in _FIELDS})


def load_from_proto(msg: load_pb2.EngineLoad) -> EngineLoad:
    return EngineLoad(**{name: getattr(msg, name) for name in _FIELDS})


async def fetch_loads(channel: grpc.aio.Channel, timeout_s: float) -> list[EngineLoad]:
    """The loads of every engine core behind `channel`; raises grpc.aio.AioRpcError when the
    service does not answer within `timeout_s` (down, still starting, or too old to serve it)."""
    reply = await load_pb2_grpc.LoadServiceStub(channel).GetLoad(load_pb2.GetLoadRequest(), timeout=timeout_s)
    return [load_from_proto(core) for core in reply.cores]
