"""bench/cuda_check.py's --families: a name it does not build is a usage error naming the ones it does."""

from __future__ import annotations

import argparse

import pytest

from bench.cuda_check import families_flag
from tests.families import FAMILIES


def test_families_takes_all_or_known_names_and_names_them_when_refusing():
    assert families_flag("all") == FAMILIES
    assert families_flag("qwen3_vl, llava_onevision") == ["qwen3_vl", "llava_onevision"]
    for text in ("qwen2_vl,qwen3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="name some of qwen2_vl, qwen2_5_vl, qwen3_vl"):
            families_flag(text)
