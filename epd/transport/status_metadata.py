"""Trailing metadata that marks a status for the hops after it (stage -> gateway -> client, the
SDK included). No numpy or torch here: the SDK imports it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

RETRY_AFTER_KEY = "epd-retry-after-s"
"""Trailing metadata that marks a RESOURCE_EXHAUSTED as `Busy` (retry later, in seconds), so the
mark survives every hop: stage -> gateway -> client (HTTP 429 + Retry-After; the SDK's
`EpdError.retry_after_s`)."""


def retry_after_in(metadata: Iterable[tuple[str, Any]] | None) -> int | None:
    """The seconds `RETRY_AFTER_KEY` says to wait, or None when the metadata has no such mark."""
    for key, value in metadata or ():
        if key == RETRY_AFTER_KEY and str(value).isdigit():
            return int(value)
    return None
