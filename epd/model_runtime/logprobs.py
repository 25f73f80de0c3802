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

import math
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
    rank: int = 0
    """The token's 1-based rank in the distribution (1 + how many tokens are more likely), as vLLM
    reports it; computed for prompt tokens (`prompt_logprobs`) only: 0 for a generated token."""


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


MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
"""The most entries a request's `prompt_logprobs` may hold: prompt tokens x (k + 1), each token's own
and its k top tokens'. Prefill refuses more (RESOURCE_EXHAUSTED, 413) before the prompt runs. This is
the memory bound of the request that holds the most at the gateway: the pieces prefill sent them in,
kept as protobuf messages (about 80 bytes an entry) and, while its HTTP answer is written, vLLM's
JSON of them (dicts, token texts and bytes: about 505 bytes an entry at the peak): about 590 bytes
an entry, so 295 MiB at this bound (docs/benchmarks.md, "Prompt logprobs at the gateway"). With
k = 20: 24,966 prompt tokens; k = 5:
87,381; k = 0: 524,288. On the wire they go in pieces (`PromptLogprobs`), so no message bounds them."""

PROMPT_LOGPROBS_CHUNK_BYTES = 64 << 20
"""The float32 logits one step of `prompt_logprobs` holds at once ([positions, vocab]): a prompt's
full logits (32k positions x 152k vocabulary = 19 GiB) are never held, as vLLM computes them in chunks."""


@dataclass
class PromptLogprobRows:
    """A prompt chunk's prompt logprobs: for each position p of the chunk that has a next prompt
    token, the log-probability of token p + 1 given tokens [0, p], its rank, and the k most likely."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def extend(self, other: PromptLogprobRows) -> None:
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


def prompt_logprob_rows(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    k: int,
    vocab: int,
) -> PromptLogprobRows:
    """hidden [P, hidden]: the last hidden states of P prompt positions; next_ids [P]: the prompt
    token after each; `logits_of` the model's head ([n, hidden] -> [n, vocab]). The logits are
    computed a chunk of positions at a time (at most PROMPT_LOGPROBS_CHUNK_BYTES of float32
    logits), each chunk's log_softmax, the next token's value and rank, and the top k, so that
    memory stays bounded whatever the prompt's length."""
    import torch

    out = PromptLogprobRows([], [], [], [])
    step = max(1, PROMPT_LOGPROBS_CHUNK_BYTES // (4 * vocab))
    next_ids = next_ids.to(hidden.device)
    for start in range(0, hidden.shape[0], step):
        logprobs = torch.log_softmax(logits_of(hidden[start : start + step]).float(), dim=-1)  # [n, vocab]
        ids = next_ids[start : start + step, None]  # [n, 1]
        chosen = logprobs.gather(1, ids)  # [n, 1]
        out.logprobs += chosen[:, 0].tolist()
        out.ranks += ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        if k:
            values, top = torch.topk(logprobs, min(k, vocab), dim=-1)  # [n, k] each, in rank order
            out.top_ids += top.tolist()
            out.top_logprobs += values.tolist()
        else:
            out.top_ids += [[] for _ in range(ids.shape[0])]
            out.top_logprobs += [[] for _ in range(ids.shape[0])]
    return out


def prompt_token_logprobs(
    rows: PromptLogprobRows, prompt_ids: Sequence[int], token_text: Callable[[int], str]
) -> list[TokenLogprob]:
    """Every prompt token (`prompt_ids` [L]), tokens 1 to L-1 each with its value, rank and top k
    (`rows`, one per token); token 0 has none (nothing comes before it): its logprob is NaN, its rank
    0 and its top empty (vLLM's None; the token is there for an echo of the prompt's tokens)."""
    assert len(rows.logprobs) == len(prompt_ids) - 1, (len(rows.logprobs), len(prompt_ids))
    return [TokenLogprob(prompt_ids[0], token_text(prompt_ids[0]), math.nan)] + [
        TokenLogprob(
            token_id=token_id,
            token=token_text(token_id),
            logprob=value,
            top=tuple(TopLogprob(t, token_text(t), v) for t, v in zip(top_ids, top_values, strict=True)),
            rank=rank,
        )
        for token_id, value, rank, top_ids, top_values in zip(
            prompt_ids[1:], rows.logprobs, rows.ranks, rows.top_ids, rows.top_logprobs, strict=True
        )
    ]
