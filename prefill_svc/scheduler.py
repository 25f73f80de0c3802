"""Which prompts the next prefill step runs: a bounded waiting queue and a token budget per step.

No torch, no gRPC: plain counters, unit-tested without a model.

    add(request)       admitted into `waiting`, or ResourceExhausted when a bound is full
    schedule()         the next step: chunked prompts already started first, then waiting ones
                       in order (arrival, or by priority first under `--scheduling-policy
                       priority`: `epd.stages.scheduling`), up to `max_prefill_tokens_per_step`
                       prompt tokens
    (runner)           computes each request's `num_scheduled_tokens`, then `step_done()`
    remove(request)    finished or cancelled: its queue place and tokens are free at once

A prompt of at most `prefill_chunk_tokens` tokens runs whole in one step, batched with the others
of that step. A longer one (a long video) runs in chunks of at most that many tokens, one chunk per
step (Sarathi-Serve's chunked prefill), so the rest of each step's budget goes to the prompts
behind it instead of waiting for its whole prefill. A request with `exclusive` set (token dropping
or KV compression: `prefill_svc/pruned_prefill.py`) runs whole and alone in a step of its own.

A prefix-cache hit (`prefill_svc/prefix_cache.py`) arrives with `num_computed_tokens` =
`num_reused_tokens` > 0: it is scheduled like a chunked prompt part-way through, and the queue
bound and the step budget count only its new tokens.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from epd.prefill_svc.config import PrefillSchedulerConfig
from epd.stages.engine_core import CoreRequest, EngineLoad, Scheduler
from epd.stages.errors import Busy
from epd.stages.scheduling import WaitingQueue

if TYPE_CHECKING:
    from epd.model_runtime.adapter import Prompt
    from epd.model_runtime.logprobs import PromptLogprobRows
    from epd.model_runtime.sampling import GenerationConfig
    from epd.prefill_svc.prefix_cache import PrefixView
    from epd.stages.contracts import EncodedMedia
    from epd.token_pruning import PruningConfig


@dataclass(eq=False)
class PrefillRequest(CoreRequest):
    """One prompt on its way through the prefill core."""

    num_prompt_tokens: int = 0
    exclusive: bool = False
    """Runs whole and alone (pruning: its exact per-request semantics need the whole prompt)."""
    num_computed_tokens: int = 0
    """Prompt tokens whose KV is computed (the runner's `step_done` advances it)."""
    num_scheduled_tokens: int = 0
    """Tokens the step now running computes for it: [num_computed_tokens, + this)."""
    num_reused_tokens: int = 0
    """Prompt tokens [0, this) whose KV comes from the prefix cache (`num_computed_tokens` starts here)."""
    num_stored_tokens: int = 0
    """Prompt tokens its finished KV wrote into the prefix cache (`PrefixCache.put`; 0: none)."""
    prefix: Any = field(default=None, repr=False)
    """The prefix-cache hit (`PrefixHit`) the runner builds this request's first cache from."""
    prefix_key: Hashable | None = field(default=None, repr=False)
    """Key under which the finished prompt's KV goes into the prefix cache (None: not cached)."""
    prefix_also: PrefixView | None = field(default=None, repr=False)
    """The text-only key up to the first visual token's index: a media prompt whose text turns came
    first is found under that key too, for the text before its media (`PrefixCache.put`'s `also`)."""
    prompt: Prompt | None = field(default=None, repr=False)
    media: EncodedMedia | None = field(default=None, repr=False)
    generation: GenerationConfig | None = field(default=None, repr=False)
    grammar: Any = field(default=None, repr=False)
    """Its structured-output constraint compiled for this model (`CompiledGrammar`; None: none)."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    """Its generation's bad_words as this model's token sequences (`bad_words_token_ids`), made
    when it is prepared: a word the tokenizer cannot give is refused before the prompt runs."""
    pruning: PruningConfig | None = field(default=None, repr=False)
    prompt_logprob_rows: PromptLogprobRows | None = field(default=None, repr=False)
    """The prompt logprobs its chunks have computed so far, when its generation asked
    (`GenerationConfig.prompt_logprobs`): one per prompt position before `num_computed_tokens`."""

    @property
    def num_remaining_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens

    @property
    def num_new_tokens(self) -> int:
        """Prompt tokens this request computes (what the queue bound counts)."""
        return self.num_prompt_tokens - self.num_reused_tokens

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def step_done(self) -> None:
        """The scheduled tokens are computed."""
        self.num_computed_tokens += self.num_scheduled_tokens
        self.num_scheduled_tokens = 0


class PrefillScheduler(Scheduler[PrefillRequest]):
    """`waiting`: admitted, not yet scheduled (in the order of `config.scheduling_policy`). A prompt
    started stays first until it is prefilled: a higher-priority arrival does not preempt its chunks
    (their KV would be recomputed). `running`: scheduled at least once and not yet
    removed (chunked prompts part-way through, and every prompt of the step now running)."""

    def __init__(self, config: PrefillSchedulerConfig = PrefillSchedulerConfig()) -> None:
        self.config = config
        self.waiting: WaitingQueue[PrefillRequest] = WaitingQueue(config.scheduling_policy)
        self.running: list[PrefillRequest] = []
        self.num_queued_tokens = 0
        """Prompt tokens of every admitted request not yet removed (what the token bound counts)."""

    def add(self, request: PrefillRequest) -> None:
        cfg = self.config
        if len(self.waiting) + len(self.running) >= cfg.max_waiting_prefills:
            raise Busy(
                f"the prefill queue is full: {cfg.max_waiting_prefills} requests are waiting for their "
                "prefill (--max-waiting-prefills); retry shortly or add prefill capacity"
            )
        if self.num_queued_tokens + request.num_new_tokens > cfg.max_waiting_prompt_tokens:
            raise Busy(
                f"the prefill queue is full: {self.num_queued_tokens} prompt tokens are waiting and this "
                f"prompt adds {request.num_new_tokens}, over the limit of {cfg.max_waiting_prompt_tokens} "
                "(--max-waiting-prompt-tokens); retry shortly, send fewer frames, or add prefill capacity"
            )
        self.waiting.push(request, request.priority)
        self.num_queued_tokens += request.num_new_tokens

    def schedule(self) -> list[PrefillRequest]:
        budget = self.config.max_prefill_tokens_per_step
        chunk = self.config.prefill_chunk_tokens
        batch: list[PrefillRequest] = []
        for r in self.running:  # chunked prompts already started: one more chunk each
            if budget == 0:
                break
            if r.is_prefilled:  # done, its removal not yet seen
                continue
            r.num_scheduled_tokens = min(r.num_remaining_tokens, chunk or r.num_remaining_tokens, budget)
            budget -= r.num_scheduled_tokens
            batch.append(r)
        while self.waiting and budget > 0:
            r = self.waiting.peek()
            if r.exclusive:
                if batch:  # it gets a step of its own, the next one
                    break
                r.num_scheduled_tokens = r.num_prompt_tokens
            elif chunk is not None and r.num_remaining_tokens > chunk:
                r.num_scheduled_tokens = min(chunk, budget)
            elif r.num_remaining_tokens <= budget or not batch:  # (over the whole budget, unchunked: alone)
                r.num_scheduled_tokens = r.num_remaining_tokens
            else:  # a whole prompt that does not fit what is left: first in the next step (no skipping)
                break
            self.running.append(self.waiting.pop())
            budget -= r.num_scheduled_tokens
            batch.append(r)
            if r.exclusive:
                break
        return batch

    def remove(self, request: PrefillRequest) -> None:
        if not self.waiting.remove(request):
            if request not in self.running:
                return  # already removed (finished and cancelled in the same step, or removed twice)
            self.running.remove(request)
        self.num_queued_tokens -= request.num_new_tokens

    def requests(self) -> list[PrefillRequest]:
        return [*self.running, *self.waiting]

    def load(self) -> EngineLoad:
        return EngineLoad(stage="prefill", num_running=len(self.running), num_waiting=len(self.waiting))
