"""Start the Encode service: `start(config)` for tests, `main(config)` for `epd serve encoder`."""

from __future__ import annotations

import functools
import logging

from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.servicer import SERVICE_NAME, EncoderServicer
from epd.encoder_svc.stage import LocalEncodeStage, build_encode_core
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.threads import StepThreads, pin_torch_threads
from epd.stages.model_thread import ModelThread, close_in_turn
from epd.transport.load_servicer import stage_loads, with_load_service
from epd.transport.server import HealthyServer, create_server, run_service
from epd.v1 import encoder_pb2_grpc

log = logging.getLogger(__name__)


async def start(config: EncoderConfig) -> HealthyServer:
    """Listen at once (health NOT_SERVING), load the vision tower, then report SERVING."""
    servicer = EncoderServicer(config)
    hs = await create_server(
        config.server,
        with_load_service(
            lambda s: encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, s),
            lambda: stage_loads(servicer.stage),
        ),
        [SERVICE_NAME],
    )
    model_thread = ModelThread(StepThreads(config.model.num_threads, "encoder"))
    # A model that cannot be loaded (ModelLoadError) ends start-up; the server must close first.
    async with hs.closed_on_failure(model_thread.close):
        adapter = await model_thread.run(load_adapter, config.model, "encoder")
        pin_torch_threads(1)  # the event loop's thread: tensors in and out, never a second OpenMP team
        engine = EncoderEngine(config, adapter)
        core = build_encode_core(engine, model_thread)  # tower jobs of all requests, batched per step
        servicer.stage = LocalEncodeStage(engine, model_thread, core=core)
        # After the drain: the decode workers and request drivers, then the model thread, for at
        # most --close-timeout-s in all (the workers' own bound does not add to the model thread's).
        closers = [servicer.stage.close, model_thread.close]
        hs.closers += [functools.partial(close_in_turn, closers, config.server.close_timeout_s)]
        await hs.set_serving(True)
    log.info("encoder serving on port %d", hs.port)
    return hs


async def main(config: EncoderConfig) -> None:
    await run_service(start(config), config.server.grace_s)
