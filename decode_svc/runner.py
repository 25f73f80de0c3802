"""The decode core's model runner: one forward pass advances every running request by one token.

`execute(batch)` runs on the model thread:
  1. requests that just arrived join: their Generation starts from the prefill's token (that token
     is their first output), and their transferred cache is copied into a new row of the batch
     cache (`BatchKv`); the transferred tensors are dropped right after;
  2. one `decode_batch` forward over all rows: token ids [B], positions [4, B] -> logits [B, vocab];
     each Generation samples from its own row with its own sampler (so greedy, seeded sampling,
     stop strings and limits behave exactly as when it runs alone); the rows whose request asked
     for logprobs get them first, computed together (`batch_logprobs`);
  3. requests with decode-stage eviction decode alone, one `step()` each, in the same engine step
     (eviction shrinks their cache per layer and head, which one shared cache cannot hold), and so
     do all requests of a family without batched decoding (`supports_batched_decode`).
Each request's output of a step is a list of TokenSteps, or `RequestFailed` when its own sampling
or its own cache failed (it leaves alone; the batched forward failing fails the batch). Joining
(1.) happens in `admit`, a model-thread call of its own before the step, so the prefill's token
reaches the client without waiting for the step's forward pass.

`release` frees a request's row (the last row moves into its place); the batch cache is freed
when the last request leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from epd.decode_svc.engine import DecodeEngine
from epd.decode_svc.scheduler import DecodeRequest
from epd.model_runtime.batch_kv import BatchKv
from epd.model_runtime.logprobs import batch_logprobs
from epd.model_runtime.sampling import SamplingFailed
from epd.stages.contracts import TokenStep
from epd.stages.engine_core import ModelRunner, RequestFailed

log = logging.getLogger(__name__)


class DecodeRunner(ModelRunner[DecodeRequest]):
    admits_first = True  # a joining request's first token (the prefill's) needs no forward pass

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.adapter = engine.adapter
        self.batch: BatchKv | None = None
        self.rows: list[DecodeRequest] = []  # rows[i].row == i

    def admit(self, requests: Sequence[DecodeRequest]) -> list[tuple[DecodeRequest, Any]]:
        """Join the requests whose KV cache has arrived: their first output is the prefill's token,
        sent before the next batched forward (which then gives their second). A request whose
        cache cannot join fails alone."""
        outputs: list[tuple[DecodeRequest, Any]] = []
        for r in requests:
            try:
                outputs.append((r, [self._join(r)]))
            except Exception as exc:  # noqa: BLE001 - e.g. a cache that does not fit the model
                outputs.append((r, RequestFailed(exc)))
        return outputs

    def execute(self, batch: Sequence[DecodeRequest]) -> list[tuple[DecodeRequest, Any]]:
        outputs: dict[DecodeRequest, list[TokenStep]] = {r: [] for r in batch}
        failed: dict[DecodeRequest, RequestFailed] = {}
        for r in batch:
            if r.generation is None:  # not admitted first (a caller driving the runner directly)
                outputs[r].append(self._join(r))
        if self.rows:
            assert self.batch is not None
            positions = torch.stack([r.generation.positions for r in self.rows], dim=1)  # [4, B]
            logits = self.adapter.decode_batch(
                [r.generation.last_token for r in self.rows], positions, self.batch
            )  # [B, vocab]
            rows = batch_logprobs(logits, [r.generation.num_logprobs for r in self.rows])
            for i, (r, row_logits) in enumerate(zip(self.rows, logits, strict=True)):
                self._advance(r, partial(r.generation.accept, row_logits, rows.get(i)), outputs, failed)
        for r in batch:
            if r.row is None and not r.finished and not outputs[r]:
                self._advance(r, r.generation.step, outputs, failed)  # alone: decode-stage eviction
        return [(r, failed.get(r, steps)) for r, steps in outputs.items()]

    @staticmethod
    def _advance(
        r: DecodeRequest,
        next_step: Callable[[], TokenStep],
        outputs: dict[DecodeRequest, list[TokenStep]],
        failed: dict[DecodeRequest, RequestFailed],
    ) -> None:
        """One request's token of this step. What fails in its own sampling or its own cache (NaN
        logits under a temperature, an eviction step) fails it alone: the rows of the others were
        computed, and their tokens go out."""
        try:
            step = next_step()
        except Exception as exc:  # noqa: BLE001 - one request's failure, not the batch's
            # extra: this runs on a model thread, outside the request's context (its log filter's id).
            # Scores it cannot sample are its settings' or input's doing: one line, no traceback.
            report = log.warning if isinstance(exc, SamplingFailed) else log.exception
            report(
                "decoding request %s failed at a step; the other requests go on: %s",
                r.request_id,
                exc,
                extra={"request_id": r.request_id},
            )
            failed[r] = RequestFailed(exc)
            r.finished = True
            return
        if r in outputs:
            outputs[r].append(step)
        r.finished = r.generation.done

    def _join(self, r: DecodeRequest) -> TokenStep:
        h = r.handle
        assert h is not None, "a decode request carries its prefill handle"
        kv, r.kv = r.kv, None  # the runner owns the transferred cache now
        # Alone: decode-stage eviction (its cache shrinks per layer and head) or a family that
        # cannot batch its decode state.
        alone = (
            r.pruning.decode_evict and h.visual_entry_mask is not None
        ) or not self.adapter.supports_batched_decode
        r.generation = self.engine.start(
            kv,
            h.first_token_id,
            h.next_position_ids,
            r.generation_config,
            h.visual_entry_mask,
            r.pruning,
            own_cache=alone,
            prompt_token_ids=h.distinct_prompt_token_ids,
            first_logprob=h.first_logprob,
            grammar=r.grammar,
            prompt_ends_reasoning=h.prompt_ends_reasoning,
        )
        first = r.generation.first()
        first.kv_transfer_ms = r.kv_transfer_ms
        first.kv_num_bytes = r.kv_num_bytes
        r.finished = r.generation.done
        if not alone and not r.finished:
            if self.batch is None:
                self.batch = self.adapter.new_batch_kv()
            r.row = self.batch.add(kv, max(q.final_length for q in (*self.rows, r)))
            self.rows.append(r)
        return first

    def release(self, r: DecodeRequest) -> None:
        if r.row is not None and self.batch is not None:
            moved = self.batch.remove(r.row)
            if moved is not None:
                self.rows[r.row] = self.rows[moved]
                self.rows[r.row].row = r.row
            self.rows.pop()
            r.row = None
        if r.generation is not None:
            r.generation.close()
        r.kv = None
