"""The options a request leaves unset take (`Pipeline.request_defaults`, every door's): the
server's, with the sampling ones --generation-config gives (auto: the model's, from prefill's
model info, as vLLM's), fitted to what prefill takes; and vLLM's warning naming the model's
defaults once they are known."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from epd.model_runtime.generation_defaults import GenerationDefaults, ModelDefaults, announce
from epd.model_runtime.sampling import MAX_NEW_TOKENS, GenerationConfig
from epd.stages.contracts import PrefillStage
from epd.stages.errors import Unavailable
from epd.stages.model_info import ModelInfo

log = logging.getLogger(__name__)

MODEL_INFO_WAIT_S = 5.0
"""How long a request under --generation-config auto waits for prefill's model info when it came
before any replica answered (prefill just started serving); beyond, it asks prefill once itself
(`wait_model_info`), whose answer or error is the request's."""


class RequestDefaults:
    """One pipeline's request defaults; it remembers the model's sampling defaults it last logged,
    so that they are announced once (and again when they change)."""

    def __init__(self) -> None:
        self._announced: tuple[ModelDefaults | None] | None = None
        """The model's sampling defaults last logged (`_announce`); None: none logged yet."""

    async def resolve(
        self,
        configured: GenerationDefaults,
        info: ModelInfo | None,
        prefill: PrefillStage,
        check: Callable[[GenerationConfig], object] | None = None,
    ) -> GenerationConfig:
        """The options a request leaves unset take: the server's, with the sampling ones
        `configured` gives (--generation-config; auto: the model's, from prefill's model info
        `info`, with the override over them), and max_tokens no more than prefill's limit, nor than
        `max_model_len` leaves after a one-token prompt (vLLM fits its default to what the model
        takes: a prefill limit under the default refused every request without max_tokens).
        Under auto a request that comes before `prefill` has said waits for it (up to
        `MODEL_INFO_WAIT_S`; the gateway reads it every 0.25 s until a replica answers), then asks
        once itself: prefill's error (a refusal, UNAVAILABLE) is the request's, and never is it
        answered with defaults other than the model's. `check` (a door's parse of its request)
        runs first under the server's own defaults when it is to wait: a malformed request is
        refused at once (400 / INVALID_ARGUMENT), as once the info is known, not after the wait
        with prefill's error."""
        if configured.from_model:
            if info is None:
                if check is not None:
                    check(_fitted(configured.resolve(None), None))
                wait = getattr(prefill, "wait_model_info", None)  # a test's stand-in may have none
                info = await wait(MODEL_INFO_WAIT_S) if callable(wait) else None
            if info is None:
                raise Unavailable(
                    "the model's sampling defaults (--generation-config auto) are not known yet: no prefill "
                    "replica has answered with its model info; retry once prefill serves (or start the "
                    "gateway with --generation-config vllm or DIR)"
                )
            self._announce(info.generation_defaults, configured)
        return _fitted(configured.resolve(None if info is None else info.generation_defaults), info)

    def _announce(self, model: ModelDefaults | None, configured: GenerationDefaults) -> None:
        """vLLM's warning naming the model's defaults taken, once they are first known (and again
        when prefill's change: a model replaced behind the gateway)."""
        if self._announced == (model,):
            return
        self._announced = (model,)
        if model is None:
            log.warning(
                "--generation-config auto: prefill does not report its model's sampling defaults (a prefill "
                "from before them, replicas whose models' differ, or a generation_config.json it could not "
                "use: see its log); the server's own are taken"
            )
        announce(configured.resolve(model), configured.source)


def _fitted(defaults: GenerationConfig, info: ModelInfo | None) -> GenerationConfig:
    """`defaults` with max_tokens no more than prefill's limit (`info`; None: the stages' default),
    nor than `max_model_len` leaves after a one-token prompt."""
    limit = MAX_NEW_TOKENS if info is None else min(info.max_new_tokens, max(1, info.max_model_len - 1))
    if defaults.max_new_tokens <= limit:
        return defaults
    return replace(defaults, max_new_tokens=limit)
