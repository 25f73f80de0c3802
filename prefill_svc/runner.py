"""One prefill step on the model thread: what `PrefillScheduler.schedule` picked, in one batch.

    step = [whole prompts] + [first chunks] + [next chunks of prompts already started]
        rows without a cache  -> one right-padded forward (adapter.prefill_chunks)
        rows with a cache     -> the chunk after the row's own cache
    a request whose last token is computed -> first token + handle (`first_token.finish_prefill`)

A request with token dropping or KV compression (`exclusive`) is always alone in its step and runs
`pruned_prefill` whole, exactly as before batching. The runner owns each part-way request's cache
between its chunks and frees it in `release`.

A prefix-cache hit starts part-way: its first chunk continues from a copy of the stored entry's KV
[0, reused) (`PrefillEngine.prefix_start_cache`), built at its first step, so a waiting hit holds
no copy. A finished prompt's KV goes into the prefix cache (`PrefillEngine.remember`) before
`finish_prefill` casts it to the request's kv_dtype.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from epd.model_runtime.adapter import PrefillChunk
from epd.model_runtime.sampling import SamplingFailed
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.first_token import PrefillOutput, finish_prefill
from epd.prefill_svc.request_inputs import request_features
from epd.prefill_svc.scheduler import PrefillRequest
from epd.prefill_svc.whole_prefill import prefill_pruned_request
from epd.stages.engine_core import ModelRunner, RequestFailed
from epd.stages.errors import EpdError

log = logging.getLogger(__name__)


class PrefillRunner(ModelRunner[PrefillRequest]):
    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine
        self.adapter = engine.adapter
        self._caches: dict[PrefillRequest, Any] = {}
        """The adapter's cache of each chunked request part-way through (tokens [0, num_computed))."""

    def execute(self, batch: Sequence[PrefillRequest]) -> list[tuple[PrefillRequest, Any]]:
        if len(batch) == 1 and batch[0].exclusive:
            return [(batch[0], self._run_exclusive(batch[0]))]
        rows = []
        for r in batch:
            assert r.prompt is not None
            start = r.num_computed_tokens
            if r not in self._caches and r.prefix is not None:  # a prefix-cache hit's first step
                self._caches[r] = self.engine.prefix_start_cache(r)
                r.prefix = None  # the copy is made: an eviction may now free the entry
            features = request_features(self.adapter, r)  # a text-only request's: no rows
            rows.append(
                PrefillChunk(
                    r.prompt,
                    features.embeds,
                    start,
                    start + r.num_scheduled_tokens,
                    self._caches.get(r),
                    deepstack=features.deepstack,  # Qwen3-VL's, row for row
                    prompt_logprobs=None if r.generation is None else r.generation.prompt_logprobs,
                )
            )
        results = self.adapter.prefill_chunks(rows)
        outputs: list[tuple[PrefillRequest, Any]] = []
        for r, result in zip(batch, results, strict=True):
            r.step_done()
            if result.prompt_logprobs is not None:  # this chunk's positions, after the earlier chunks'
                if r.prompt_logprob_rows is None:
                    r.prompt_logprob_rows = result.prompt_logprobs
                else:
                    r.prompt_logprob_rows.extend(result.prompt_logprobs)
            if not r.is_prefilled:
                self._caches[r] = result.cache
                continue
            self._caches.pop(r, None)
            r.finished = True
            cache = self.adapter.chunk_cache_to_kv(result.cache)
            self.engine.remember(r, cache)
            try:
                out: PrefillOutput | RequestFailed = finish_prefill(
                    self.adapter, r, cache, result.last_logits, _ms_since(r.first_scheduled_s)
                )
            except EpdError as exc:  # this request's own settings: it fails alone
                out = RequestFailed(exc)
            except SamplingFailed as exc:  # scores its settings or input made NaN: alone, one line
                log.warning(
                    "prefill of request %s failed after its forward pass; the others go on: %s",
                    r.request_id,
                    exc,
                    extra={"request_id": r.request_id},
                )
                out = RequestFailed(exc)
            except Exception as exc:  # noqa: BLE001 - e.g. its sampler on NaN logits: it fails alone too
                # extra: this runs on a model thread, outside the request's context (its log filter's id).
                log.exception(
                    "prefill of request %s failed after its forward pass; the others go on",
                    r.request_id,
                    extra={"request_id": r.request_id},
                )
                out = RequestFailed(exc)
            outputs.append((r, out))
        return outputs

    def release(self, request: PrefillRequest) -> None:
        self._caches.pop(request, None)

    @property
    def num_partial(self) -> int:
        """Requests part-way through a chunked prefill (their caches are held here)."""
        return len(self._caches)

    def _run_exclusive(self, request: PrefillRequest) -> PrefillOutput | RequestFailed:
        """Whole and alone; a refusal (e.g. a budget its key tokens cannot meet) fails it alone."""
        request.finished = True
        try:
            out = prefill_pruned_request(self.adapter, request)
        except EpdError as exc:
            return RequestFailed(exc)
        request.num_scheduled_tokens = request.num_remaining_tokens
        request.step_done()
        return out


def _ms_since(monotonic_s: float | None) -> float:
    return 0.0 if monotonic_s is None else (time.monotonic() - monotonic_s) * 1e3
