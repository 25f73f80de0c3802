"""The tiny checkpoint builders (`epd.model_runtime.tiny_model`): which families they build."""

from __future__ import annotations

import pytest

from epd.model_runtime.tiny_model import TINY_FAMILIES, TinyVLMSpec, build_model, build_processor
from tests.families import FAMILIES


def test_the_builders_build_every_family_epd_serves():
    """Every model type the loader serves has a tiny checkpoint for the every-family tests
    (`family_checkpoints`): Qwen3-VL MoE's is built from Qwen3-VL's (tests/families.py)."""
    assert set(FAMILIES) == {*TINY_FAMILIES, "qwen3_vl_moe"}


@pytest.mark.parametrize("build", [build_processor, lambda spec: build_model(spec, None)])
def test_an_unknown_family_is_refused_naming_every_family(build):
    """Before anything is built (the processor would otherwise be Qwen2-VL's, silently), with
    every family the builders take named, the three added since the message was written too."""
    with pytest.raises(ValueError, match="^unknown model family 'glm4'; use ") as info:
        build(TinyVLMSpec(family="glm4"))
    assert all(repr(family) in str(info.value) for family in TINY_FAMILIES)
