"""The gateway's replica file (`--replicas-file PATH`): the stage replicas to route over, changed
at run time without a restart.

The file is JSON or YAML, a mapping from stage to its addresses:

    {"encoder": ["10.0.0.5:50051", "10.0.0.6:50051"], "prefill": ["10.0.0.7:50052"],
     "decode": ["dns:///epd-decode-headless:50053"]}

A stage the file leaves out keeps the addresses of its flag (--encoder, --prefill, --decode). The
gateway re-reads the file when its modification time or size changes (polled every
`poll_interval_s`; applied once it is the same at two polls in a row, so that a file caught
half-written is not) and on SIGHUP, and applies it to the stages' replica pools: a new replica gets
calls from the next request (it joins healthy; the health checks take it out if it does not
serve), a removed one gets no new calls and its channel closes when its calls end. A file that
does not parse, names an unknown stage or leaves a stage with no address is refused as a whole:
the log says why and routing stays as it was. A `dns:///name:port` address keeps working as a
single replica whose channel balances over every address behind the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from epd.transport.remote_stages import ReplicaPool

log = logging.getLogger(__name__)

STAGES = ("encoder", "prefill", "decode")
POLL_INTERVAL_S = 1.0
"""How often the file's modification time is looked at (a stat: cheap)."""


class ReplicaFileError(ValueError):
    """The replica file cannot be used; the message says what to change."""


def parse_replicas(text: str, source: str = "the replica file") -> dict[str, tuple[str, ...]]:
    """Stage -> addresses from the file's text (JSON or YAML); ReplicaFileError when unusable."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ReplicaFileError(f"{source} is not valid JSON or YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ReplicaFileError(f"{source} must be a mapping like {{\"encoder\": [\"HOST:PORT\", ...]}}")
    out: dict[str, tuple[str, ...]] = {}
    for stage, addresses in data.items():
        if stage not in STAGES:
            raise ReplicaFileError(f"{source} names an unknown stage {stage!r}; use {', '.join(STAGES)}")
        if isinstance(addresses, str):
            addresses = addresses.split(",")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ReplicaFileError(f"{source}: {stage} must be a list of \"HOST:PORT\" strings")
        cleaned = tuple(dict.fromkeys(a.strip() for a in addresses if a.strip()))
        if not cleaned:
            raise ReplicaFileError(f"{source}: {stage} needs at least one address (leave it out to keep its flag's)")
        out[stage] = cleaned
    return out


def read_replicas(path: str | Path) -> dict[str, tuple[str, ...]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ReplicaFileError(f"cannot read the replica file {path}: {exc.strerror or exc}") from None
    return parse_replicas(text, f"the replica file {path}")


class ReplicaListWatcher:
    """Applies the replica file to the pools now (`reload`) and whenever it changes (`run`)."""

    def __init__(
        self,
        path: str | Path,
        pools: Mapping[str, ReplicaPool],
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.path = Path(path)
        self.pools = dict(pools)
        self.poll_interval_s = poll_interval_s
        self._seen: tuple[int, int] | None = None
        self._settling: tuple[int, int] | None = None
        """A changed file's stamp, seen at the last poll and not yet applied."""
        self._hup = asyncio.Event()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self) -> bool:
        """Re-read the file and apply it; False (and the reason logged) when it is refused."""
        self._seen = self._stamp()
        try:
            lists = read_replicas(self.path)
        except ReplicaFileError as exc:
            log.error("%s; routing stays as it was", exc)
            return False
        for stage, addresses in lists.items():
            pool = self.pools.get(stage)
            if pool is None:
                continue
            added, removed = pool.set_addresses(list(addresses))
            if added or removed:
                # WARNING, the default level: a change of topology belongs in every log.
                log.warning("%s replicas now %s (added %s, removed %s)", stage, ", ".join(addresses),
                         ", ".join(added) or "none", ", ".join(removed) or "none")
        return True

    def changed(self) -> bool:
        return self._stamp() != self._seen

    async def run(self, install_sighup: bool = True) -> None:
        """Poll the file (and wait for SIGHUP) until cancelled."""
        stop_listening: Callable[[], object] | None = None
        if install_sighup:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, self._hup.set)
                # Not remove_signal_handler: that restores SIGHUP's default, and a SIGHUP during the
                # gateway's drain (this task ends when the stop begins) then killed it on the spot.
                # The loop's close removes this no-op with its other handlers.
                stop_listening = lambda: loop.add_signal_handler(  # noqa: E731
                    signal.SIGHUP, log.info, "SIGHUP while stopping: the replica file is not re-read")
        try:
            while True:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._hup.wait(), self.poll_interval_s)
                if self._hup.is_set():
                    self._hup.clear()
                    log.info("SIGHUP: re-reading the replica file %s", self.path)
                    self.reload()
                elif self.changed():
                    # Applied once it has stopped changing for a poll: a file read while an editor
                    # or `cat > file` was writing it (cut at a line, still valid YAML) applied a
                    # shortened list until the next poll.
                    stamp = self._stamp()
                    if stamp == self._settling:
                        self._settling = None
                        self.reload()
                    else:
                        self._settling = stamp
        finally:
            if stop_listening is not None:
                stop_listening()
