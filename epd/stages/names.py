"""The names of a request's stages, as users see them: in stage events (gRPC stream, SDK, CLI),
in timings (`timings_ms` of the gRPC summary, the HTTP API's `epd` object, the SDK, `epd ask
--json`) and in the docs. `Stage` is the one list; everything else derives from it.

Two different things were both called "decode": decoding the video into frames (the encoder
service) and generating tokens (the decode service). Users now see `video_decode` for the first
and `generate` for the second. For one release (0.2.x; removed in 0.3) the old timing name
"decode" is still emitted next to "video_decode", and the old names are accepted on input.

Plain Python (no torch, no gRPC): the SDK imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum


class Stage(str, Enum):
    """A stage of one request, in the order a request passes them."""

    UPLOAD = "upload"
    """The media bytes arriving at the front door (gRPC `Ask`)."""
    VIDEO_DECODE = "video_decode"
    """Decoding the sampled frames of the video (encoder service)."""
    ENCODE = "encode"
    """The vision tower turning frames into visual tokens (encoder service)."""
    PREFILL = "prefill"
    """The language model reading the prompt into a KV cache (prefill service)."""
    KV_TRANSFER = "kv_transfer"
    """The decoder pulling that KV cache from prefill (inside generation's first step)."""
    GENERATE = "generate"
    """Token generation (decode service)."""

    # A str mixin prints as "Stage.ENCODE" by default; events and JSON need the name itself.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, name: str) -> Stage | str:
        """The Stage called `name`, old names included ("decode" -> VIDEO_DECODE); a name this
        version does not know (a newer server's) comes back unchanged rather than failing."""
        if name in LEGACY_STAGE_NAMES:
            return LEGACY_STAGE_NAMES[name]
        try:
            return cls(name)
        except ValueError:
            return name


LEGACY_STAGE_NAMES: Mapping[str, Stage] = {"decode": Stage.VIDEO_DECODE}
"""Old name -> stage. Accepted on input; "decode" is still emitted as a timing until 0.3."""

TIMED_STAGES: tuple[Stage, ...] = (
    Stage.VIDEO_DECODE,
    Stage.ENCODE,
    Stage.PREFILL,
    Stage.KV_TRANSFER,
    Stage.GENERATE,
)
"""Stages with a duration in `timings_ms`, in timeline order (UPLOAD is timed by its event only)."""

TTFT = "ttft"
"""Timing: the first token's time since the request reached the front door."""
TOTAL = "total"
"""Timing: the whole request."""

TIMING_NAMES: tuple[str, ...] = (*(s.value for s in TIMED_STAGES), TTFT, TOTAL)
"""Every key of `timings_ms` (milliseconds), legacy aliases aside."""


def timings_with_legacy_names(timings_ms: Mapping[str, float]) -> dict[str, float]:
    """`timings_ms` as the wire and JSON carry it in 0.2: every timing under its name, plus each
    renamed one under its old name too, so that readers of the old name keep working."""
    out = {str(name): value for name, value in timings_ms.items()}
    for old, stage in LEGACY_STAGE_NAMES.items():
        if stage.value in out:
            out[old] = out[stage.value]
    return out


def timings_from_either(timings_ms: Mapping[str, float]) -> dict[str, float]:
    """`timings_ms` received from a server of either version: old names become new ones (the new
    name wins when both came) and are dropped."""
    out = {name: value for name, value in timings_ms.items() if name not in LEGACY_STAGE_NAMES}
    for old, stage in LEGACY_STAGE_NAMES.items():
        if old in timings_ms:
            out.setdefault(stage.value, timings_ms[old])
    return out
