"""Module hooks confined to the thread that registered them.

The colocated server runs steps of different stages at once on one model (`epd.stages.model_thread`,
`workers`): a hook that one step registers on a shared module (the query capture of the text-guided
prefill drop, Qwen3.5's neutral padding of a batched prefill) must not act on another thread's
forward through the same module. Hooks returning None leave the module's input and output as they are.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


def owner_thread_only(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, acting only when called in the thread that wraps it (wrap it where it is registered)."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def confined(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return None
        return hook(*args, **kwargs)

    return confined
