"""The decode runner's logprobs of a batched step (`batch_logprobs`, `rows_logprobs`) on plain
tensors: only the rows whose request asked, each with its own k; none when nobody asked."""

from __future__ import annotations

import torch

from epd.model_runtime.logprobs import batch_logprobs, rows_logprobs, token_logprob


def test_only_the_rows_that_asked_get_logprobs_each_with_its_k():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [B, vocab]
    rows = batch_logprobs(logits, [None, 3, None, 0, 7])
    assert set(rows) == {1, 3, 4}
    for i, k in ((1, 3), (3, 0), (4, 7)):
        want = torch.log_softmax(logits[i].float(), dim=-1)  # float32, whatever the model's dtype
        assert torch.equal(rows[i].logprobs, want)
        values, ids = torch.topk(want, k)
        assert rows[i].top_ids == ids.tolist() and rows[i].top_logprobs == values.tolist()


def test_a_step_where_nobody_asked_computes_nothing():
    assert batch_logprobs(torch.zeros(2, 8), [None, None]) == {}


def test_the_sampled_token_has_its_own_value_outside_the_top():
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    row = rows_logprobs(logits, [1])[0]
    entry = token_logprob(row, 3, lambda t: f"<{t}>")
    assert entry.token == "<3>" and entry.logprob == float(torch.log_softmax(logits[0], -1)[3])
    assert [(t.token_id, t.token) for t in entry.top] == [(1, "<1>")]


def test_the_bounds_of_a_requests_logprobs_name_where_they_come_from():
    import pytest

    from epd.model_runtime.sampling import GenerationConfig

    with pytest.raises(ValueError, match=r"between 0 and 20 \(--max-logprobs\), got 21"):
        GenerationConfig(logprobs=21).validate(64, 1000, max_logprobs=20)
    # The decoder's own bound: the vocabulary (prefill and the gateway hold requests to --max-logprobs).
    with pytest.raises(ValueError, match=r"between 0 and 8 \(this model's vocabulary size\), got 9"):
        GenerationConfig(logprobs=9).validate(64, 8)
    with pytest.raises(ValueError, match="must be 0 or more, got -1"):
        GenerationConfig(logprobs=-1).validate(64)
    GenerationConfig(logprobs=0).validate(64, 8, max_logprobs=0)
