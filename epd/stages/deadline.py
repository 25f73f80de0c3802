"""The client's deadline of the request a task serves, for the calls made on its behalf.

A front door that knows when its client gives up (the gateway's gRPC calls: `Ask`, `Tokenize`,
`Detokenize` carry a gRPC deadline; a stage's own, the prefill servicer's `Prefill` and
`Tokenize`) sets it here for the request's task (`set_client_deadline`); the calls the request
makes to remote stages then last at most what the client has left
(`timeout_within_client_deadline`), so each stage gets the client's deadline with its call, not
only the gateway's stage timeout (`GatewayConfig.stage_timeout_s`, no flag), and the local stages read it where they wait
(`client_deadline`: prefill's render checkpoints refuse a render whose deadline passed while it
waited for a thread). One shape for both: the prefill servicer sets its call's deadline here as
the gateway does, so `LocalPrefillStage` behind it, and behind an embedded pipeline's caller (`epd
serve --colocate`'s gateway, or any code that sets it around `Pipeline.ask`), checks the same
deadline. gRPC ends a stage's handler at that deadline by itself, so its work is freed even when
the gateway's cancel does not reach it (a gateway stalled, or a cancel lost as a call starts).
Tasks started from the request's task inherit the deadline (contextvars), as they inherit its id
(`epd.stages.request_id`); work done for several requests, an encode others wait on, runs with
none (`shared_work_context`: no one client's deadline ends it). No gRPC here.

Clean-ups that must outlive the client (a KV cache's release) do not read it: they keep their
own timeout.
"""

from __future__ import annotations

import contextvars
import time

_client_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "epd_client_deadline", default=None
)
"""time.monotonic() at which the request's client gives up; None: it set no deadline."""


def set_client_deadline(time_remaining_s: float | None) -> None:
    """The request this task serves ends for its client in `time_remaining_s` seconds (a gRPC
    context's `time_remaining()`); None: the client set no deadline."""
    _client_deadline.set(None if time_remaining_s is None else time.monotonic() + time_remaining_s)


def client_deadline() -> float | None:
    """time.monotonic() at which the client of this task's request gives up; None: no deadline."""
    return _client_deadline.get()


def client_time_left_s() -> float | None:
    """Seconds until the client of this task's request gives up (0 once past); None: no deadline."""
    deadline = _client_deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def timeout_within_client_deadline(timeout_s: float) -> float:
    """`timeout_s` (a stage call's own limit), or less: what the client has left."""
    left = client_time_left_s()
    return timeout_s if left is None else min(timeout_s, left)
