"""Start the Prefill service: `start(config)` for tests, `main(config)` for `epd serve prefill`."""

from __future__ import annotations

import functools
import logging

from epd.model_runtime.loader import load_adapter
from epd.model_runtime.threads import StepThreads, pin_torch_threads
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.servicer import SERVICE_NAME, PrefillServicer
from epd.prefill_svc.stage import LocalPrefillStage, build_prefill_core
from epd.stages.model_thread import ModelThread, close_in_turn
from epd.transport.load_servicer import stage_loads, with_load_service
from epd.transport.server import HealthyServer, create_server, run_service
from epd.v1 import prefill_pb2_grpc

log = logging.getLogger(__name__)


async def start(config: PrefillConfig) -> HealthyServer:
    kv_store = KvStore(config.kv_store_bytes, config.kv_ttl_s)
    servicer = PrefillServicer(config, kv_store)
    hs = await create_server(
        config.server,
        with_load_service(
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
            lambda: stage_loads(servicer.stage),
        ),
        [SERVICE_NAME],
    )
    kv_address = config.advertise_address or f"{config.server.host}:{hs.port}"
    model_thread = ModelThread(StepThreads(config.model.num_threads, "prefill"))
    # A model that cannot be loaded (ModelLoadError) ends start-up; the server must close first.
    async with hs.closed_on_failure(model_thread.close):
        adapter = await model_thread.run(load_adapter, config.model, "prefill")
        pin_torch_threads(1)  # the event loop's thread: tensors in and out, never a second OpenMP team
        engine = PrefillEngine(config, adapter)
        core = build_prefill_core(engine, model_thread)  # scheduler + batched runner on the model thread
        servicer.stage = LocalPrefillStage(engine, kv_store, model_thread, kv_address, core=core)
        # After the drain: the core's loop, then the tokenizer threads, the model thread and the
        # structured-output compiles, waited for off the loop for at most --close-timeout-s in all (a
        # looping trusted chat template or a pathological regex must not hold the shutdown, nor
        # add its wait to the model thread's). The compiles last: one cannot be stopped and may
        # run for minutes, so the model thread's step is waited for first.
        threads = [servicer.stage.close_tokenizer, model_thread.close, servicer.stage.close_compiles]
        hs.closers += [
            servicer.stage.close,
            functools.partial(close_in_turn, threads, config.server.close_timeout_s),
        ]
        await hs.set_serving(True)
    log.info("prefill serving on port %d, KV caches pulled from %s", hs.port, kv_address)
    return hs


async def main(config: PrefillConfig) -> None:
    await run_service(start(config), config.server.grace_s)
