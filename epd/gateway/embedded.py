"""The whole pipeline in one process: one model, local stages, no ports."""

from __future__ import annotations

import asyncio

from epd.decode_svc.config import DecodeConfig
from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.stage import LocalDecodeStage, take_from_store
from epd.encoder_svc.config import EncoderConfig
from epd.encoder_svc.engine import EncoderEngine
from epd.encoder_svc.stage import LocalEncodeStage
from epd.gateway.config import SharedModelSchedule
from epd.gateway.pipeline import Pipeline
from epd.model_runtime.adapter import VLMAdapter
from epd.model_runtime.config import ModelConfig
from epd.model_runtime.loader import load_adapter
from epd.model_runtime.threads import AUTO, CallThreads, StepThreads, pin_torch_threads
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.model_thread import CLOSE_WAIT_S, ModelThread, close_in_turn


class EmbeddedPipeline(Pipeline):
    """The three local stages on one model thread pool. `close()` (or leaving a `with` block)
    stops the threads they started: the model threads, the encoder's decode workers and request
    drivers, and waits for the calls they are running. A process that builds one pipeline for its
    life needs no close: the model threads and decode workers of one still open at interpreter exit
    are closed then (`ModelThread`, `ParallelDecoder`), and the drivers joined (Python's own
    executors); one that builds many (tests, `epd bench quality` per preset) would otherwise keep
    every pipeline's threads."""

    def __init__(
        self,
        encoder: LocalEncodeStage,
        prefill: LocalPrefillStage,
        decoder: LocalDecodeStage,
        thread: ModelThread,
        close_timeout_s: float = CLOSE_WAIT_S,
    ) -> None:
        super().__init__(encoder, prefill, decoder)
        self.encoder: LocalEncodeStage = encoder
        self.prefill: LocalPrefillStage = prefill
        self.decoder: LocalDecodeStage = decoder
        self.model_thread = thread
        self.close_timeout_s = close_timeout_s
        """`close`'s one deadline by default (`--close-timeout-s`: `epd serve --colocate`, `epd ask`)."""

    def close(self, wait_s: float | None = None) -> None:
        """Stop the stages' threads and wait for them (calls running finish; queued ones are
        cancelled): the encoder's decode workers, prefill's tokenizer threads, the model threads,
        then the structured-output compiles (prefill's and decode's: one compiler per model), for
        at most `wait_s` in all (default `close_timeout_s`; `close_in_turn`; the
        encoder's part also within its own `parallel_decoder.CLOSE_WAIT_S`); a thread still running
        then is named in a warning and left (a looping trusted chat template, a pathological
        regex's compile cannot be stopped). The pipeline takes no request after it. Idempotent."""
        parts = [
            self.encoder.close,
            self.prefill.close_tokenizer,
            self.model_thread.close,
            self.prefill.close_compiles,
        ]
        close_in_turn(parts, self.close_timeout_s if wait_s is None else wait_s)

    async def aclose(self) -> None:
        await super().aclose()
        await asyncio.to_thread(self.close)  # it waits for the calls still running: not on the loop

    def __enter__(self) -> EmbeddedPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_embedded_pipeline(
    model: ModelConfig,
    encoder: EncoderConfig | None = None,
    prefill: PrefillConfig | None = None,
    adapter: VLMAdapter | None = None,
    decode: DecodeConfig | None = None,
    schedule: SharedModelSchedule = SharedModelSchedule(),
    close_timeout_s: float = CLOSE_WAIT_S,
) -> EmbeddedPipeline:
    """Loads the model once (vision + language) on the first model thread and wires the three
    local stages to it; `close_timeout_s`: its close's one deadline (`EmbeddedPipeline.close`). The calling thread, which runs no model call, is left one torch thread
    (so it never starts an OpenMP team of its own: epd.model_runtime.threads)."""
    encoder = encoder or EncoderConfig(model=model)
    prefill = prefill or PrefillConfig(model=model)
    auto = model.num_threads == AUTO
    thread = ModelThread(
        threads=None if auto else StepThreads(model.num_threads),  # a fixed count on every model thread
        deferred_lanes=schedule.deferred_lanes(),
        first_calls_ahead=schedule.first_calls_ahead(),
        workers=schedule.concurrent_steps,
        call_threads=CallThreads() if auto else None,
    )
    try:
        adapter = adapter or thread.call(load_adapter, model, "all")
        prefill_engine = PrefillEngine(prefill, adapter)  # ModelLoadError: --max-model-len over the model's
    except BaseException:
        thread.close()
        raise
    pin_torch_threads(1)
    kv_store = KvStore(prefill.kv_store_bytes, prefill.kv_ttl_s)
    return EmbeddedPipeline(
        LocalEncodeStage(EncoderEngine(encoder, adapter), thread),
        LocalPrefillStage(prefill_engine, kv_store, thread),
        LocalDecodeStage(
            DecodeEngine(adapter), take_from_store(kv_store), thread, decode or DecodeConfig(model=model)
        ),
        thread,
        close_timeout_s,
    )
