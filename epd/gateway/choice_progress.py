"""One choice's answer as its tokens come (a request asks for n of them, all from one prefill):
the first token from prefill's handle, sent before a decoder has the cache, then its decoder's
steps without that token again (`after_sent`), with their logprobs when the request asked.
`epd.gateway.pipeline` keeps one `ChoiceProgress` per choice."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from epd.gateway.ask_types import ChoiceSummary
from epd.model_runtime.detokenizer import StopReason
from epd.model_runtime.logprobs import TokenLogprob
from epd.stages.contracts import PrefillHandle, TokenStep


@dataclass
class ChoiceProgress:
    """A choice's answer so far, and how far its decoder got (`Pipeline._run`)."""

    index: int
    logprobs: list[TokenLogprob] | None = None
    """[] when the request asked for logprobs: one per token of `token_ids` as they come."""
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: StopReason = None
    sent: TokenStep | None = None
    """The first token, sent from prefill's handle."""
    source: PrefillHandle | None = None
    """The handle whose cache its decoder pulled (set at the decoder's first step, which comes
    only after the pull); None while it has none."""
    ended: bool = False
    """The decoder's stream ran to its end."""
    kv_num_bytes_pulled: int = 0
    """What its decoder pulled from a prefill server (0: taken in-process)."""

    @property
    def taken(self) -> bool:
        return self.source is not None

    def add(self, step: TokenStep) -> None:
        self.token_ids += step.token_ids
        if self.logprobs is not None:
            self.logprobs += step_logprobs(step)
        self.text_parts.append(step.text)
        if step.finish_reason:
            self.finish_reason, self.stop_reason = step.finish_reason, step.stop_reason

    def summary(self) -> ChoiceSummary:
        return ChoiceSummary(
            self.index,
            "".join(self.text_parts),
            self.token_ids,
            self.finish_reason,
            self.stop_reason,
            self.logprobs,
        )


def after_sent(step: TokenStep, sent: TokenStep) -> TokenStep | None:
    """The decoder's first step without the token already sent from prefill's handle (None: nothing
    is left to send). Prefill works that token's text out with the decoder's rules (`OutputText`),
    so the step starts with it; anything else is a bug, and the stream stops rather than show the
    client two versions of its answer."""
    n = len(sent.token_ids)
    if step.token_ids[:n] != sent.token_ids or not step.text.startswith(sent.text):
        raise RuntimeError(
            f"the decoder's first step ({step.token_ids[:n]}, {step.text!r}) does not start with the "
            f"token sent from prefill ({sent.token_ids}, {sent.text!r})"
        )
    rest = replace(
        step,
        token_ids=step.token_ids[n:],
        text=step.text[len(sent.text) :],
        logprobs=None if step.logprobs is None else step.logprobs[n:],
    )
    return rest if rest.token_ids or rest.text or rest.finish_reason else None


def first_logprob(handle: PrefillHandle) -> TokenLogprob:
    """The first token's logprob from prefill's handle, for a request that asked for logprobs."""
    if handle.first_logprob is None or handle.first_logprob.token_id != handle.first_token_id:
        raise RuntimeError("prefill answered a request that asked for logprobs without its first token's")
    return handle.first_logprob


def step_logprobs(step: TokenStep) -> list[TokenLogprob]:
    """A decoder step's logprobs, one per token, for a request that asked for them."""
    if not step.token_ids:
        return []
    if step.logprobs is None or len(step.logprobs) != len(step.token_ids):
        raise RuntimeError(
            f"the decoder sent {len(step.token_ids)} tokens with "
            f"{0 if step.logprobs is None else len(step.logprobs)} logprobs to a request that asked for them"
        )
    return step.logprobs
