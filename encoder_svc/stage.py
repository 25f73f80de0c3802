"""The encode stage in this process: `EncoderEngine` behind the `EncodeStage` contract.

Used by the encoder's gRPC servicer and by the embedded mode (`epd ask` without --endpoint).
The per-request driver (demux, waiting for frames, token cache) runs on a bounded `RequestPool`
thread and only its model calls on the `ModelThread`. Cancelling `encode` (the client went away)
sets the driver's cancel flag: decoding stops at the next frame group and queued model calls are
dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from epd.encoder_svc.engine import EncoderEngine
from epd.stages.contracts import (
    EncodedMedia,
    EncodeStage,
    EventSink,
    MediaInput,
    RequestCancelled,
    StageEvent,
)
from epd.stages.model_thread import ModelThread
from epd.stages.request_pool import RequestPool
from epd.token_pruning import PruningConfig
from epd.video.types import SamplingOptions

log = logging.getLogger(__name__)


def _decodes_full(num_running: int, num_waiting: int) -> str:
    return (
        f"the encoder is decoding {num_running} videos and {num_waiting} more requests are waiting; "
        "retry shortly, or start the encoder with a larger --max-concurrent-decodes or "
        "--max-queued-decodes"
    )


class LocalEncodeStage(EncodeStage):
    def __init__(self, engine: EncoderEngine, model_thread: ModelThread) -> None:
        self.engine = engine
        self.model_thread = model_thread
        self.drivers = RequestPool(
            engine.config.max_concurrent_decodes,
            engine.config.max_queued_decodes,
            _decodes_full,
            thread_name="encode-driver",
        )

    async def encode(
        self,
        media: MediaInput,
        sampling: SamplingOptions,
        on_event: EventSink,
        request_id: str,
        pruning: PruningConfig = PruningConfig(),
    ) -> EncodedMedia:
        loop = asyncio.get_running_loop()

        def drive(cancel: threading.Event) -> EncodedMedia:  # on a request-pool thread
            def threadsafe(event: StageEvent) -> None:
                if not cancel.is_set():  # nobody listens any more (and the loop may be gone)
                    loop.call_soon_threadsafe(on_event, event)

            try:
                return self.engine.encode(
                    media, sampling, threadsafe, pruning, run_model=self.model_thread.call, cancel=cancel
                )
            except RequestCancelled as exc:
                log.info("encode of request %s stopped: %s", request_id, exc)
                raise

        try:
            return await self.drivers.run(drive)
        except asyncio.CancelledError:
            log.info("encode of request %s cancelled by its caller; its decoding stops", request_id)
            raise
