"""What the served model can take, as the front door needs it without loading the model: the
vocabulary (a request's `logit_bias` / `stop_token_ids` ids are checked against it before its media
costs an encode), the longest prompt plus answer (`/v1/models`' `max_model_len`) and the model's
sampling defaults (its generation_config.json's, under the front door's --generation-config auto).

Prefill owns it (`PrefillStage.model_info`): the embedded pipeline reads its local prefill stage's,
the gateway of the stack reads every prefill replica's over `PrefillService.GetModelInfo` in the
background (`epd.gateway.model_info`) and keeps `common_model_info` of the answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from epd.model_runtime.logprobs import MAX_LOGPROBS
from epd.model_runtime.reasoning_markers import REASONING_MARKERS


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int | None
    """Rows of the model's logits: token ids 0 to vocab_size - 1 (None: not known)."""
    context_tokens: int | None
    """Prompt plus generated tokens at most, as prefill serves them: config.json's
    max_position_embeddings, or prefill's --max-model-len, which may only lower it (None: not known)."""
    max_prompt_tokens: int
    """The longest prompt prefill takes, in tokens: `PrefillConfig.max_prompt_tokens` (--max-prompt-tokens), or
    `context_tokens` when that is shorter (`PrefillConfig.served_prompt_tokens`)."""
    max_new_tokens: int
    """The most tokens a request may ask for (prefill's `max_new_tokens_limit`, --max-new-tokens-limit):
    the gateway refuses more before the media costs an encode (`Pipeline.max_new_tokens_limit`)."""
    model_type: str = ""
    """config.json's model_type."""
    max_logprobs: int = MAX_LOGPROBS
    """The most top tokens a request may ask for at each position (prefill's --max-logprobs): the
    gateway refuses more before the media costs an encode."""
    reasoning_markers: tuple[str, ...] = ()
    """Which of `REASONING_MARKERS` are single tokens of the model's tokenizer, in that order: a
    thinking model's (Qwen3, Qwen3.5, DeepSeek-R1) has both, Qwen2-VL's neither. The front door
    refuses chat requests under `--reasoning-parser` without both (`epd.gateway.reasoning`)."""
    reasoning_marker_ids: tuple[int, ...] = ()
    """The token id of each of `reasoning_markers`, in that order: the front door counts a thinking
    answer's reasoning tokens by them, as vLLM's reasoning parsers count by token id (it has no
    tokenizer). () when not known: a prefill from before them, or replicas whose ids differ."""
    trust_request_chat_template: bool = False
    """Prefill renders a request's own `chat_template` (--trust-request-chat-template): the front
    door refuses one without it before the media costs an encode (prefill refuses it too)."""
    scheduling_policy: str = "fcfs"
    """Prefill's --scheduling-policy (`epd.stages.scheduling`): under fcfs the front door refuses a
    request's non-zero priority before its media costs an encode (`epd serve` gives every stage
    the same policy; a stage started by hand with another refuses such a request itself)."""
    generation_defaults: tuple[tuple[str, float | int], ...] | None = ()
    """The sampling fields of the model's generation_config.json (`SAMPLING_KEYS` of
    `epd.model_runtime.generation_defaults`, as (key, value) pairs in that order): the defaults of a
    request's unset fields under the front door's --generation-config auto, which holds no model
    folder (vLLM's server reads them where it loads the model). () when the model sets none; None
    when not known (a prefill from before them, or replicas whose models' differ)."""

    def reasoning_token_id(self, marker: str) -> int | None:
        """`marker`'s token id (one of `reasoning_markers`), or None when it is not a single token
        or its id is not known."""
        if (
            len(self.reasoning_marker_ids) != len(self.reasoning_markers)
            or marker not in self.reasoning_markers
        ):
            return None
        return self.reasoning_marker_ids[self.reasoning_markers.index(marker)]

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus answer a request may have: what vLLM's /v1/models reports as
        `max_model_len` and its clients size `max_tokens` by. The model's context, unless epd's
        own limits on the prompt and on the answer add up to less."""
        limits = self.max_prompt_tokens + self.max_new_tokens
        return limits if self.context_tokens is None else min(self.context_tokens, limits)


def common_model_info(infos: Iterable[ModelInfo]) -> ModelInfo | None:
    """One view of the replicas of a stage: their info when they agree, None when none is known.
    Replicas that disagree serve different models or limits (a misconfiguration, or a rolling
    change); then the bounds every one of them enforces: the largest vocabulary (an id outside it
    every replica refuses, so refusing it early refuses nothing a replica would serve) and the
    smallest context and limits (a request within them fits whichever replica gets it)."""
    distinct = set(infos)
    if len(distinct) <= 1:
        return next(iter(distinct), None)

    def smallest(values: Iterable[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    vocab = [i.vocab_size for i in distinct]
    # a marker only when every replica's tokenizer has it: the parser works on whichever answers;
    # its id only when every replica's is the same (else the reasoning is counted by its text)
    markers = tuple(m for m in REASONING_MARKERS if all(m in i.reasoning_markers for i in distinct))
    ids = [{i.reasoning_token_id(m) for i in distinct} for m in markers]
    marker_ids = tuple(token for same in ids if len(same) == 1 for token in same if token is not None)
    return ModelInfo(
        vocab_size=None if None in vocab else max(v for v in vocab if v is not None),
        context_tokens=smallest(i.context_tokens for i in distinct),
        max_prompt_tokens=min(i.max_prompt_tokens for i in distinct),
        max_new_tokens=min(i.max_new_tokens for i in distinct),
        model_type=",".join(sorted({i.model_type for i in distinct})),
        max_logprobs=min(i.max_logprobs for i in distinct),
        reasoning_markers=markers,
        reasoning_marker_ids=marker_ids if len(marker_ids) == len(markers) else (),
        # only when every replica takes them: any of them may get the request
        trust_request_chat_template=all(i.trust_request_chat_template for i in distinct),
        # priority only when every replica orders by it: a replica under fcfs would refuse the request
        scheduling_policy="priority" if all(i.scheduling_policy == "priority" for i in distinct) else "fcfs",
        # a model's defaults only when every replica reports the same: which replica's would be
        # arbitrary (the disagreement is logged, naming each replica's)
        generation_defaults=defaults.pop()
        if len(defaults := {i.generation_defaults for i in distinct}) == 1
        else None,
    )
