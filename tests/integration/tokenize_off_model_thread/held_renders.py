"""What the tests of prefill's tokenizer threads share: a conversation, the hang guard, and renders
of a slow chat template held until the test lets them go (a prefill or a /tokenize with it, under
a client deadline)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from epd.model_runtime.sampling import GenerationConfig
from epd.prefill_svc.config import PrefillConfig
from epd.prefill_svc.engine import PrefillEngine
from epd.prefill_svc.kv_store import KvStore
from epd.prefill_svc.stage import LocalPrefillStage
from epd.stages.deadline import set_client_deadline
from epd.stages.messages import ChatTemplateOptions, from_chat_template
from epd.stages.model_thread import ModelThread
from epd.stages.tokenize import TokenizeInput

T = TypeVar("T")

HANG_GUARD_S = 60.0
"""Only ends a test that would otherwise wait forever (a call stuck behind the held model thread)."""


def _conversation(question: str) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]},
        {"role": "user", "content": [{"type": "text", "text": question}]},
    ]


SLOW_TEMPLATE = (
    "{% for i in range(20000) %}{% endfor %}"  # a loop of the template's own (the gate below holds it longer)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content[-1].text }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _hold_slow_renders(adapter, rendering: threading.Event, release: threading.Event) -> None:
    """Make `adapter` hold each render with `SLOW_TEMPLATE` at its start (setting `rendering`) until
    `release`; `del adapter._render` undoes it."""
    render = adapter._render

    def held_render(conversation, options):
        if options.chat_template == SLOW_TEMPLATE:
            rendering.set()
            release.wait(3 * HANG_GUARD_S)  # past the test's own waits: the test ends it
        return render(conversation, options)

    adapter._render = held_render


@contextlib.contextmanager
def _slow_renders_held(adapter, rendering, release: threading.Event, model_thread: ModelThread):
    """`_hold_slow_renders` for the block; after it, the class's render again, every held render
    let go, and `model_thread` closed."""
    _hold_slow_renders(adapter, rendering, release)
    try:
        yield
    finally:
        del adapter._render  # the class's method again
        release.set()
        model_thread.close()


class _Entered:
    """Stands for `_hold_slow_renders`' event: counts the renders that entered, each a release."""

    def __init__(self) -> None:
        self.renders = threading.Semaphore(0)
        self.num_renders = 0

    def set(self) -> None:
        self.num_renders += 1
        self.renders.release()

    def wait_for(self, num_renders: int) -> bool:
        return all(self.renders.acquire(timeout=HANG_GUARD_S) for _ in range(num_renders))


def _trusting_stage(adapter, model_thread: ModelThread) -> LocalPrefillStage:
    config = PrefillConfig(trust_request_chat_template=True)
    return LocalPrefillStage(PrefillEngine(config, adapter), KvStore(1 << 30, 600.0), model_thread)


def _with_client_deadline(call: Callable[[], Awaitable[T]], deadline_s: float | None) -> asyncio.Future[T]:
    """`call()` in a task of its own with the client deadline `deadline_s` (time.monotonic();
    None: none) set for it, as the prefill servicer sets its gRPC call's (`epd.stages.deadline`)."""

    async def run() -> T:
        if deadline_s is not None:
            set_client_deadline(deadline_s - time.monotonic())
        return await call()

    return asyncio.ensure_future(run())


def _slow_prefill(stage: LocalPrefillStage, request_id: str, deadline_s: float | None = None):
    return _with_client_deadline(
        lambda: stage.prefill(
            from_chat_template(_conversation("what colour is the circle?")),
            None,
            GenerationConfig(max_new_tokens=1),
            request_id,
            template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
        ),
        deadline_s,
    )


def _slow_tokenize(stage: LocalPrefillStage, request_id: str, deadline_s: float | None = None):
    request = TokenizeInput(
        messages=from_chat_template(_conversation("what colour is the circle?")),
        add_special_tokens=False,
        template=ChatTemplateOptions(chat_template=SLOW_TEMPLATE),
    )
    return _with_client_deadline(lambda: stage.tokenize(request, request_id), deadline_s)
