"""Whether a port a service of the stack is about to be restarted on is free, and which process holds
it when it is not: another process can take a port while the service that had it is down (killed,
crashed), and the restart then fails to bind. The launcher looks before it restarts
(epd/cli/launcher.py): a stage replica moves to a free port, the gateway waits (its clients know
its port)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"  # a socket bound but not listening is in no table: its holder is not found
_COMMAND_CHARS = 120


def port_taken(host: str, port: int) -> bool:
    """Whether binding `host`:`port` fails because another socket has it. SO_REUSEADDR, as gRPC
    binds: the TIME_WAIT connections the service left behind do not hold its port."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def port_holder(port: int) -> str | None:
    """'pid N (its command line)' of a process listening on TCP port `port`, as far as /proc shows
    (Linux; another user's processes' sockets are not ours to see): None if unknown."""
    inodes = _bound_socket_inodes(port)
    if not inodes:
        return None
    for pid in (name for name in os.listdir("/proc") if name.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                continue
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        command = command.strip()
        if len(command) > _COMMAND_CHARS:
            command = command[: _COMMAND_CHARS - 3] + "..."
        return f"pid {pid} ({command})"
    return None


def _bound_socket_inodes(port: int) -> set[str]:
    """'socket:[INODE]' of each TCP socket listening on local port `port`."""
    inodes = set()
    for table in _TCP_TABLES:
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            if len(fields) < 10 or fields[3] != _LISTEN or fields[9] == "0":
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes
