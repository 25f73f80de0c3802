"""The internal secrets of this process, followed in their file (`--internal-secret-file`) without
a restart.

A rotation (docs/security.md, "Rotating the internal secret") changes the file three times; a
mounted Kubernetes Secret (or a compose secret edited in place) changes under the running
services. Every use asks `InternalSecrets.current()`: the stage servers' check of each call
(`epd.transport.auth.InternalSecretInterceptor`), the secret the gateway and decode present on
each call (`epd.transport.security.stage_channel`), and each server's own look on a timer
(`follow_secret_file`), so that an idle service follows a change too. At most every `check_interval_s`
(`--secret-check-interval-s`, `TransportSecurity.secret_check_interval_s`) that looks at
the file's identity (device, inode, modification time, size: a Secret's update swaps in a new file,
an edit in place changes the time or size) and re-reads it only when that changed. A file that
cannot be used any more (unreadable, empty, a malformed line) keeps the secrets read before and
logs an ERROR once per change of the file: refusing every call for a bad edit would be an outage,
and the last good secrets are what the other services still hold.

Pure bookkeeping plus a stat; no gRPC. The comparison stays constant-time
(`epd.transport.auth.any_key_matches` over `current()`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from epd.stages.server_config import SECRET_CHECK_INTERVAL_S, TransportSecurity, read_secrets

log = logging.getLogger(__name__)

Stamp = tuple[int, int, int, int] | str
"""(device, inode, mtime_ns, size) of the file, or why it could not be looked at."""


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)  # follows the symlinks of a mounted Secret (..data -> a new directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class InternalSecrets:
    """The secrets a service presents (the first) and accepts (all), re-read from `path` when it
    changes; without a path (`$EPD_INTERNAL_SECRET`, tests) they never change."""

    def __init__(
        self,
        secrets: Sequence[str],
        path: str = "",
        check_interval_s: float = SECRET_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._secrets = tuple(secrets)
        self._stamp = _stamp(path) if path else ""
        """The file as it was when `_secrets` (or a refused version of it) was read."""
        self._next_check_s = clock() + check_interval_s
        self._lock = threading.Lock()  # callers: the event loop, and threads of grpc's sync API

    def current(self) -> tuple[str, ...]:
        """Every accepted secret, the presented one first (the file's lines, as of the last look)."""
        if self.path and self._clock() >= self._next_check_s:
            with self._lock:
                if self._clock() >= self._next_check_s:
                    self._next_check_s = self._clock() + self.check_interval_s
                    self._look()
        return self._secrets

    @property
    def presented(self) -> str:
        """The secret this service presents on its calls to stages ("" = none)."""
        secrets = self.current()
        return secrets[0] if secrets else ""

    def _look(self) -> None:
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            secrets = read_secrets(self.path)
        except ValueError as exc:  # unreadable, empty, a line that is no secret: one line saying why
            log.error("%s; keeping the internal secrets read before until the file changes again", exc)
            return
        if secrets != self._secrets:
            # WARNING, the default level: who presents and accepts what belongs in every log.
            log.warning(
                "--internal-secret-file %s changed: now presenting its first line, accepting its %d",
                self.path,
                len(secrets),
            )
        self._secrets = secrets


async def follow_secret_file(secrets: InternalSecrets) -> None:
    """Look at `secrets`' file every `check_interval_s` whether or not calls come (a task of each
    server's, `create_server`): a rotation is followed, and logged, by every service before the
    operator's next step (docs/security.md), an idle one's too. Its calls alone did that while the
    gateway read every stage's load twice a second; idle, it reads none now."""
    while True:
        await asyncio.sleep(secrets.check_interval_s)
        secrets.current()


_shared: dict[tuple[str, tuple[str, ...], float], InternalSecrets] = {}
_shared_lock = threading.Lock()


def internal_secrets(security: TransportSecurity) -> InternalSecrets:
    """This process's view of `security`'s secrets: one object per secret file (its server's check
    and its channels' secret follow the file together), a fixed one without a file."""
    if not security.internal_secret_file:
        return InternalSecrets(security.accepted_internal_secrets)
    key = (
        security.internal_secret_file,
        security.accepted_internal_secrets,
        security.secret_check_interval_s,
    )
    with _shared_lock:
        if key not in _shared:
            _shared[key] = InternalSecrets(
                security.accepted_internal_secrets,
                security.internal_secret_file,
                security.secret_check_interval_s,
            )
        return _shared[key]
