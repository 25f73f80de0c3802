"""Every metric the docs name is one a gateway's /metrics exposes, and every one it exposes is named
in README.md."""

from __future__ import annotations

import re

import pytest

from tests.unit.docs.doc_reading import USER_DOCS, VLLM_GUIDE, exposed_metrics, read


@pytest.mark.parametrize("doc", (*USER_DOCS, VLLM_GUIDE))
def test_every_metric_the_docs_name_is_exposed(doc):
    exposed = exposed_metrics()
    named = set(re.findall(r"\bepd_[a-z0-9_]+\b", read(doc)))
    missing = sorted(
        n for n in named if not (n in exposed or n.endswith("_") and any(e.startswith(n) for e in exposed))
    )
    assert not missing, f"{doc} names metrics /metrics does not have: {missing}"


def test_every_exposed_metric_is_named_in_the_readme():
    text = read("README.md")
    named = set(re.findall(r"\bepd_[a-z0-9_]+\b", text))
    prefixes = {n for n in named if n.endswith("_")}
    unnamed = sorted(
        e for e in exposed_metrics() if e not in named and not any(e.startswith(p) for p in prefixes)
    )
    assert not unnamed, f"README.md's Metrics section does not name: {unnamed}"
