"""Log-probabilities of generated tokens (OpenAI's and vLLM's `logprobs` / `top_logprobs`).

What is returned is vLLM's default `--logprobs-mode raw_logprobs`: `log_softmax` in float32 of the
model's own logits for the position, before anything the request's sampling does to them
(allowed_token_ids, bad_words, temperature, penalties, logit_bias, min_tokens, min_p, top-k, top-p:
"raw means the values before applying any logit processors, like bad words", vLLM's words). So they equal
`torch.log_softmax(generate(..., output_logits=True).logits[i].float(), -1)` of the unsplit model,
whatever the sampling settings, and the token a request sampled always has its own value, whether or
not it is among the `k` most likely.

The first token is sampled by prefill, the others by decode; both compute them here, only for the
requests that asked (`GenerationConfig.logprobs` not None), so a step where nobody asked costs
nothing. The token texts are each id decoded alone (special tokens kept), as vLLM shows them.

This module's dataclasses are plain Python (the gateway reads them without torch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20
"""vLLM's default `--max-logprobs` (and OpenAI's bound on `top_logprobs`): the most top tokens a
request may ask for at each position, unless the server's --max-logprobs says otherwise."""


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token_id: int
    token: str
    """The id decoded alone, special tokens kept (a piece of a multi-byte character reads "\ufffd")."""
    logprob: float
    """float32 log-probability under the raw model distribution (-inf possible for a masked logit)."""


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token at one position, its log-probability, and the `k` most likely tokens' in
    rank order (k = the request's `logprobs`; the sampled token may or may not be among them)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class RowLogprobs:
    """One row's distribution, computed before its token is sampled (`rows_logprobs`)."""

    logprobs: torch.Tensor
    """[vocab] float32: log_softmax of the row's raw logits."""
    top_ids: list[int]
    """The k most likely ids, in rank order."""
    top_logprobs: list[float]


def rows_logprobs(logits: torch.Tensor, ks: Sequence[int]) -> list[RowLogprobs]:
    """logits [R, vocab] (any float dtype), one row per request that asked, `ks[i]` its k ->
    each row's distribution and top k. One log_softmax and one topk (of the largest k) for the
    rows together; each row keeps its own first k."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab] float32
    k_max = min(max(ks, default=0), logprobs.shape[-1])
    if k_max:
        values, ids = torch.topk(logprobs, k_max, dim=-1)  # [R, k_max] each, in rank order
        values_list, ids_list = values.tolist(), ids.tolist()
    else:
        values_list = ids_list = [[] for _ in ks]
    return [RowLogprobs(logprobs[i], ids_list[i][:k], values_list[i][:k]) for i, k in enumerate(ks)]


def batch_logprobs(logits: torch.Tensor, ks: Sequence[int | None]) -> dict[int, RowLogprobs]:
    """A batched decode step's logits [B, vocab] and each row's k (None: its request did not ask)
    -> {row: its RowLogprobs} for the rows that asked, computed together (`rows_logprobs` of those
    rows alone); {} when none asked, so a step without logprobs costs nothing more."""
    import torch

    asked = [(i, k) for i, k in enumerate(ks) if k is not None]
    if not asked:
        return {}
    index = torch.tensor([i for i, _ in asked], device=logits.device)  # [R]: beside the logits (a GPU)
    rows = rows_logprobs(logits.index_select(0, index), [k for _, k in asked])
    return {i: row for (i, _), row in zip(asked, rows, strict=True)}


def token_logprob(row: RowLogprobs, token_id: int, token_text: Callable[[int], str]) -> TokenLogprob:
    """The sampled `token_id`'s entry of `row` (computed before it was sampled)."""
    return TokenLogprob(
        token_id=token_id,
        token=token_text(token_id),
        logprob=float(row.logprobs[token_id]),
        top=tuple(
            TopLogprob(t, token_text(t), v) for t, v in zip(row.top_ids, row.top_logprobs, strict=True)
        ),
    )
