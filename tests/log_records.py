"""The log records a logger writes while a block runs, each with its `request_id` as the
services' handlers see it (`epd.transport.tracing.RequestIdFilter`, which `epd --log-format`
installs): for tests that check a line carries its request's id, from whatever thread logs it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from epd.transport import tracing


@contextmanager
def log_records(logger_name: str, level: int = logging.INFO) -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.addFilter(tracing.RequestIdFilter())
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    old_level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
