"""Start the Decode service: `start(config)` for tests, `main(config)` for `epd serve decode`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.kv_pull import KvPuller
from epd.decode_svc.servicer import SERVICE_NAME, DecodeServicer
from epd.decode_svc.stage import LocalDecodeStage
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.structured_output import close_compiler
from epd.model_runtime.threads import StepThreads, lower_cpu_priority, pin_torch_threads
from epd.stages.model_thread import ModelThread, close_in_turn
from epd.transport.load_servicer import stage_loads, with_load_service
from epd.transport.server import HealthyServer, create_server, run_service
from epd.v1 import decode_pb2_grpc

log = logging.getLogger(__name__)


async def start(config: DecodeConfig) -> HealthyServer:
    model_thread = ModelThread(StepThreads(config.model.num_threads, "decode"))
    puller = KvPuller(config.allow_kv_from, config.max_transfer_bytes, config.pull_timeout_s)
    servicer = DecodeServicer()
    hs = await create_server(
        config.server,
        with_load_service(
            lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s),
            lambda: stage_loads(servicer.stage),
        ),
        [SERVICE_NAME],
    )
    # A model that cannot be loaded (ModelLoadError) ends start-up; the server must close first.
    async with hs.closed_on_failure(model_thread.close):
        adapter = await model_thread.run(load_adapter, config.model, "decode")
        pin_torch_threads(1)  # the event loop's thread: tensors in and out, never a second OpenMP team
        servicer.stage = LocalDecodeStage(
            DecodeEngine(adapter), puller.take_kv, model_thread, config, confirm_kv=puller.confirm_kv
        )
        # After the drain: the core's loop and its receipts to prefill, the KV channels, then the model
        # thread and the structured-output compiles (last: one cannot be stopped), against one
        # deadline (`close_in_turn`, --close-timeout-s), as prefill's.
        threads: list[Callable[[float], object]] = [
            model_thread.close,
            functools.partial(close_compiler, adapter),
        ]
        hs.closers += [
            servicer.stage.close,
            puller.close,
            functools.partial(close_in_turn, threads, config.server.close_timeout_s),
        ]
        await hs.set_serving(True)
    log.info("decode serving on port %d", hs.port)
    return hs


async def main(config: DecodeConfig) -> None:
    # Here, not in `start`: a test that starts a decoder in its own process must not lower its own
    # priority for good. Before the model thread and gRPC's threads start, which inherit it.
    lower_cpu_priority(config.nice)
    await run_service(start(config), config.server.grace_s)
