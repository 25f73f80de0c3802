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
the log says why and routing stays as it was. A `dns:///NAME:PORT` address stands for the
addresses NAME resolves to, one replica each (`epd.gateway.dns_replicas`).

`ReplicaUpdater` is the one path by which the pools' lists change: the file's lists (`configure`)
and the lookups of the `dns:///` names (`refresh`, every `--dns-refresh-interval` seconds) both end
in `apply`, which gives each pool its stage's list as configured with every name expanded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import yaml

from epd.gateway.dns_replicas import (
    PENDING_RETRY_S,
    DnsName,
    Lookup,
    ReplicaSets,
    getaddrinfo_lookup,
    parse_dns_entry,
)
from epd.transport.aio_cancel import within
from epd.transport.replica_pool import ReplicaPool

log = logging.getLogger(__name__)

STAGES = ("encoder", "prefill", "decode")
T = TypeVar("T")

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
        raise ReplicaFileError(f'{source} must be a mapping like {{"encoder": ["HOST:PORT", ...]}}')
    out: dict[str, tuple[str, ...]] = {}
    for stage, addresses in data.items():
        if stage not in STAGES:
            raise ReplicaFileError(f"{source} names an unknown stage {stage!r}; use {', '.join(STAGES)}")
        if isinstance(addresses, str):
            addresses = addresses.split(",")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ReplicaFileError(f'{source}: {stage} must be a list of "HOST:PORT" strings')
        cleaned = tuple(dict.fromkeys(a.strip() for a in addresses if a.strip()))
        if not cleaned:
            raise ReplicaFileError(
                f"{source}: {stage} needs at least one address (leave it out to keep its flag's)"
            )
        for address in cleaned:
            try:
                parse_dns_entry(address)
            except ValueError as exc:
                raise ReplicaFileError(f"{source}: {stage}: {exc}") from None
        out[stage] = cleaned
    return out


def read_replicas(path: str | Path) -> dict[str, tuple[str, ...]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ReplicaFileError(f"cannot read the replica file {path}: {exc.strerror or exc}") from None
    return parse_replicas(text, f"the replica file {path}")


class ReplicaUpdater:
    """Keeps each stage's pool routing over its list as configured, `dns:///` names expanded to
    the addresses they resolve to (`ReplicaSets`; the lookups run off the event loop)."""

    def __init__(
        self,
        pools: Mapping[str, ReplicaPool],
        sets: ReplicaSets | None = None,
        lookup: Lookup = getaddrinfo_lookup,
    ) -> None:
        self.pools = dict(pools)
        self.sets = sets or ReplicaSets({stage: pool.addresses for stage, pool in self.pools.items()})
        """Default: the pools' lists as they are, taken as configured (names not expanded yet)."""
        self.lookup = lookup

    async def resolve(self, names: list[DnsName] | None = None) -> None:
        """Look `names` (default: every name listed) up and record what each found."""
        await look_up(self.sets, self.sets.names() if names is None else names, self.lookup)

    def apply(self) -> None:
        """Give every pool its stage's list as it is now."""
        for stage, pool in self.pools.items():
            listed = self.sets.expanded(stage)
            added, removed = pool.set_addresses(listed.addresses, listed.server_names)
            if added or removed:
                # WARNING, the default level: a change of topology belongs in every log.
                log.warning(
                    "%s replicas now %s (added %s, removed %s)",
                    stage,
                    ", ".join(listed.addresses),
                    ", ".join(added) or "none",
                    ", ".join(removed) or "none",
                )

    async def refresh(self) -> None:
        """Look every name up again and apply what changed."""
        await self.resolve()
        self.apply()

    async def configure(self, lists: Mapping[str, tuple[str, ...]]) -> None:
        """Route the stages in `lists` over those entries from now on (a reloaded replica file),
        names it adds looked up first."""
        self.sets.configure({stage: addresses for stage, addresses in lists.items() if stage in self.pools})
        await self.resolve(self.sets.never_looked_up())
        self.apply()

    async def run(self, interval_s: float) -> None:
        """Look the names never looked up yet up at once (at start-up: all of them), then every
        name every `interval_s` (0: a name found is not looked up again), and the names not found
        yet every PENDING_RETRY_S, until cancelled."""
        loop = asyncio.get_running_loop()
        if never := self.sets.never_looked_up():
            await self.resolve(never)
            self.apply()
        due = loop.time() + interval_s
        while True:
            await asyncio.sleep(min(interval_s, PENDING_RETRY_S) if interval_s > 0 else PENDING_RETRY_S)
            if interval_s > 0 and loop.time() >= due:
                due = loop.time() + interval_s
                await self.refresh()
            elif pending := self.sets.pending():
                await self.resolve(pending)
                self.apply()


async def look_up(sets: ReplicaSets, names: list[DnsName], lookup: Lookup = getaddrinfo_lookup) -> None:
    """Look `names` up at once, each in a thread (getaddrinfo blocks), and record in `sets` what
    each found; a change of a name's state is logged."""

    async def one(name: DnsName) -> list[str] | OSError:
        try:
            return list(await in_daemon_thread(lookup, name.host, name.port))
        except OSError as exc:  # socket.gaierror included
            return exc

    outcomes = await asyncio.gather(*(one(name) for name in names))
    for name, found in zip(names, outcomes):
        if (change := sets.record(name, found)) is not None:
            log.warning("%s", change)  # WARNING, the default level: a stage's replicas may depend on it


async def in_daemon_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a daemon thread of its own. Not asyncio.to_thread: the executor's threads are
    joined when the loop and the interpreter end, so a getaddrinfo hung on an unreachable DNS
    server held a stopping gateway up until the lookup gave up (tens of seconds, past the
    orchestrator's grace). Cancelling the await leaves the thread to finish alone."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: T | BaseException) -> None:
        if not future.done():
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def work() -> None:
        outcome: T | BaseException
        try:
            outcome = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=work, name=f"epd-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


class ReplicaListWatcher:
    """Applies the replica file to the pools now (`reload`) and whenever it changes (`run`)."""

    def __init__(
        self,
        path: str | Path,
        updater: ReplicaUpdater,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.path = Path(path)
        self.updater = updater
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

    async def reload(self) -> bool:
        """Re-read the file and apply it; False (and the reason logged) when it is refused."""
        self._seen = self._stamp()
        try:
            lists = read_replicas(self.path)
        except ReplicaFileError as exc:
            log.error("%s; routing stays as it was", exc)
            return False
        await self.updater.configure(lists)
        return True

    def changed(self) -> bool:
        return self._stamp() != self._seen

    async def run(self, install_sighup: bool = True, reload_first: bool = False) -> None:
        """Poll the file (and wait for SIGHUP) until cancelled; `reload_first`: apply the file as
        it is now first (once SIGHUP reloads rather than stops: the lookups of the names it adds
        may take a while)."""
        stop_listening: Callable[[], object] | None = None
        if install_sighup:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(signal.SIGHUP, self._hup.set)
                # Not remove_signal_handler: that restores SIGHUP's default, and a SIGHUP during the
                # gateway's drain (this task ends when the stop begins) then killed it on the spot.
                # The loop's close removes this no-op with its other handlers.
                stop_listening = lambda: loop.add_signal_handler(  # noqa: E731
                    signal.SIGHUP, log.info, "SIGHUP while stopping: the replica file is not re-read"
                )
        try:
            if reload_first:
                await self.reload()
            while True:
                # `within`, not asyncio.wait_for: the stop's cancel landing as a SIGHUP did was lost
                # (Python 3.11), and the watcher polled on through the drain.
                with contextlib.suppress(asyncio.TimeoutError):
                    await within(self._hup.wait(), self.poll_interval_s)
                if self._hup.is_set():
                    self._hup.clear()
                    log.info("SIGHUP: re-reading the replica file %s", self.path)
                    await self.reload()
                elif self.changed():
                    # Applied once it has stopped changing for a poll: a file read while an editor
                    # or `cat > file` was writing it (cut at a line, still valid YAML) applied a
                    # shortened list until the next poll.
                    stamp = self._stamp()
                    if stamp == self._settling:
                        self._settling = None
                        await self.reload()
                    else:
                        self._settling = stamp
        finally:
            if stop_listening is not None:
                stop_listening()
