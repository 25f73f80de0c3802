"""`LoadService`: a service process tells the gateway what its engine cores are doing.

Each service's server.py wraps its registration so the load service sits beside it:

    create_server(config.server, with_load_service(register, lambda: stage_loads(servicer.stage)), ...)

Thin adapter: no state, the loads are read from the stage at each call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from epd.stages.engine_core import EngineLoad
from epd.transport.load import load_to_proto
from epd.v1 import load_pb2, load_pb2_grpc

LOAD_SERVICE_NAME = load_pb2.DESCRIPTOR.services_by_name["LoadService"].full_name

LoadSource = Callable[[], Sequence[EngineLoad]]


def stage_loads(stage: object) -> list[EngineLoad]:
    """What `stage.load()` reports, as a list: [] while the stage is not built yet (the model is
    loading) or has no engine core; a stage with several cores may return a sequence."""
    load = getattr(stage, "load", None)
    if load is None:
        return []
    result = load()
    return [result] if isinstance(result, EngineLoad) else list(result)


class LoadServicer(load_pb2_grpc.LoadServiceServicer):
    def __init__(self, loads: LoadSource) -> None:
        self.loads = loads

    async def GetLoad(self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        return load_pb2.GetLoadResponse(cores=[load_to_proto(load) for load in self.loads()])


def with_load_service(
    register: Callable[[grpc.aio.Server], None], loads: LoadSource
) -> Callable[[grpc.aio.Server], None]:
    """`register` followed by adding the LoadService over `loads` (for `create_server`)."""

    def register_both(server: grpc.aio.Server) -> None:
        register(server)
        load_pb2_grpc.add_LoadServiceServicer_to_server(LoadServicer(loads), server)

    return register_both
