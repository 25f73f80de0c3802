"""The encoder core's model side: one vision-tower call per step for every scheduled job.

Qwen's towers take the patches of several images and videos concatenated ([sum patches,
patch_dim]) with one grid row each and attend within each image or temporal group only, so a
batched call gives each job what it gets alone, up to float32 rounding of the larger matrix
products (tests/integration/test_encoder_batching.py). Each job gets `VisualFeatures`: its
embeddings and, for Qwen3-VL, its DeepStack features split back the same way
(`VLMAdapter.encode_features_batch`). A step that fails is retried job by job, so one bad job
fails only its own request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from epd.encoder_svc.scheduler import TowerJob
from epd.model_runtime.adapter import VLMAdapter
from epd.stages.engine_core import ModelRunner, RequestFailed

log = logging.getLogger(__name__)


class EncodeRunner(ModelRunner[TowerJob]):
    def __init__(self, adapter: VLMAdapter) -> None:
        self.adapter = adapter
        self.max_batch_size = 0
        """The most jobs one tower call has taken (tests and logs)."""
        self.num_patches_encoded = 0

    def execute(self, batch: Sequence[TowerJob]) -> list[tuple[TowerJob, Any]]:
        inputs = [job.inputs for job in batch]
        if any(i is None for i in inputs):
            raise RuntimeError("a tower job was scheduled twice")
        try:
            # Embeddings and any DeepStack features (`VisualFeatures`), split back per job.
            outputs: list[Any] = self.adapter.encode_features_batch(inputs)  # type: ignore[arg-type]
        except Exception:
            if len(batch) == 1:
                raise
            log.exception("a tower step of %d frame groups failed; encoding them one by one", len(batch))
            outputs = [self._encode_alone(job) for job in batch]
        self.max_batch_size = max(self.max_batch_size, len(batch))
        for job in batch:
            self.num_patches_encoded += job.num_patches
            job.inputs = None  # the driver keeps its own reference when pruning needs the pixels
            job.finished = True
        return list(zip(batch, outputs, strict=True))

    def _encode_alone(self, job: TowerJob) -> Any:
        try:
            return self.adapter.encode_features_batch([job.inputs])[0]  # type: ignore[list-item]
        except Exception as exc:  # noqa: BLE001 - this job's request fails, the others go on
            return RequestFailed(exc)

    def release(self, request: TowerJob) -> None:
        request.inputs = None
