"""The id of the request a task serves: a context variable that the tasks it starts, and the
threads it hands work to in its context, inherit. The transport sets it at each front door and
stage server and puts it in every log line, error message and stage call about the request
(`epd.transport.tracing`, which reads and sets it through these functions); it lives here, below
the transport, so that an engine can run work that is no single request's under an id of its own
(`shared_work_context`). No gRPC here."""

from __future__ import annotations

import contextvars

from epd.stages.deadline import set_client_deadline

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("epd_request_id", default="")
_from_client: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "epd_request_id_from_client", default=False
)


def current_request_id() -> str:
    """The id of the request this task serves ("" outside one)."""
    return _request_id.get()


def request_id_from_client() -> bool:
    """Whether this task's request id is its client's (else one made for it)."""
    return _from_client.get()


def set_request_id(request_id: str, from_client: bool = False) -> contextvars.Token:
    _from_client.set(from_client)
    return _request_id.set(request_id)


def shared_work_context(work_id: str) -> contextvars.Context:
    """A copy of this task's context for work that outlives the request that started it, done for
    every request that wants its result (an encode that others wait on, `encoder_svc/single_flight`):
    its log lines carry `work_id`, not the starting request's id, and it has no client deadline
    (`epd.stages.deadline`), since it is no single client's: it ends when the last request that
    wants it leaves, each request's own deadline ending only that request's wait. Run the work with
    `context.run(fn, ...)`; what it starts from there (tasks, calls handed to threads in its
    context) inherits both."""
    context = contextvars.copy_context()
    context.run(_as_shared_work, work_id)
    return context


def _as_shared_work(work_id: str) -> None:
    set_request_id(work_id)
    set_client_deadline(None)
