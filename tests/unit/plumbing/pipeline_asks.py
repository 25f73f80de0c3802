"""The request the stage-plumbing tests ask of the real tiny model (one question about a test
video), and their hang guard.

Waits carry a generous timeout only so that a broken build fails instead of hanging; nothing
asserts on time.
"""

from __future__ import annotations

from epd.gateway.ask_types import AskRequest
from epd.model_runtime.sampling import GenerationConfig
from epd.stages.contracts import MediaInput
from epd.stages.messages import question_messages
from epd.video.types import SamplingOptions

HANG_GUARD_S = 120.0


def _ask(videos, **generation) -> AskRequest:
    return AskRequest(
        messages=question_messages("what colour is the square?"),
        media=MediaInput(videos["mp4"]),
        sampling=SamplingOptions(num_frames=4),
        generation=GenerationConfig(**generation),
    )
