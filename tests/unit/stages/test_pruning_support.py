"""Every pruning stage works per family or is refused, before any work, with INVALID_ARGUMENT
naming the stage, the service it runs in and the family (`refuse_unsupported_pruning` over each
adapter's declared `supported_pruning`)."""

from __future__ import annotations

import pytest

from epd.model_runtime.glm4v import Glm4vAdapter
from epd.model_runtime.internvl import InternVLAdapter
from epd.model_runtime.llava_onevision import LlavaOnevisionAdapter
from epd.model_runtime.qwen2_vl import Qwen2VLAdapter
from epd.model_runtime.qwen3_5 import Qwen3_5Adapter
from epd.model_runtime.qwen3_vl import Qwen3VLAdapter
from epd.stages.contracts import PRUNING_STAGES, pruning_stages_used, refuse_unsupported_pruning
from epd.stages.errors import InvalidRequest
from epd.token_pruning import PruningConfig

EVERY_STAGE = PruningConfig(
    temporal_drop=True,
    spatial_merge=True,
    key_token_ratio=0.1,
    prefill_drop=True,
    prefill_keep_ratio=0.5,
    kv_compress=True,
    kv_keep_ratio=0.5,
    decode_evict=True,
)


def _refuse(cls, family, pruning):
    refuse_unsupported_pruning(family, cls.supported_pruning, cls.pruning_refusal_reason, pruning)


def test_every_stage_is_named_by_the_config_that_turns_it_on():
    assert pruning_stages_used(EVERY_STAGE) == list(PRUNING_STAGES)
    assert pruning_stages_used(PruningConfig()) == []
    assert pruning_stages_used(PruningConfig(kv_dtype="bfloat16")) == [], "kv_dtype works for every family"


def test_qwen2_families_run_every_stage():
    _refuse(Qwen2VLAdapter, "qwen2_vl", EVERY_STAGE)


@pytest.mark.parametrize(
    "cls,family,allowed",
    [
        (Qwen3VLAdapter, "qwen3_vl", {"temporal_drop", "key_tokens"}),
        (Qwen3_5Adapter, "qwen3_5", set()),
        (LlavaOnevisionAdapter, "llava_onevision", set()),
        (Glm4vAdapter, "glm4v", set()),
        (InternVLAdapter, "internvl", set()),
    ],
)
def test_other_families_refuse_what_they_cannot_run_naming_stage_service_and_family(cls, family, allowed):
    assert set(cls.supported_pruning) == allowed
    for stage, service in PRUNING_STAGES.items():
        one = {
            "temporal_drop": PruningConfig(temporal_drop=True),
            "spatial_merge": PruningConfig(spatial_merge=True),
            "key_tokens": PruningConfig(key_token_ratio=0.1),
            "prefill_drop": PruningConfig(prefill_drop=True, prefill_keep_ratio=0.5),
            "kv_compress": PruningConfig(kv_compress=True, kv_keep_ratio=0.5),
            "decode_evict": PruningConfig(decode_evict=True),
        }[stage]
        if stage in allowed:
            _refuse(cls, family, one)
            continue
        with pytest.raises(InvalidRequest) as err:
            _refuse(cls, family, one)
        message = str(err.value)
        assert f"{stage} ({service} stage)" in message and f"model family {family}" in message
        assert cls.pruning_refusal_reason in message
