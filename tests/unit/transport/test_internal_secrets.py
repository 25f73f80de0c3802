"""The internal secrets followed in their file (`epd.transport.internal_secrets`): re-read when the
file changes (an edit in place, or a new file swapped in as a mounted Kubernetes Secret is), looked
at no more often than the check interval; a file that becomes unusable keeps the secrets read
before and says why once. A fake clock; real files."""

from __future__ import annotations

import logging
import os
import secrets

import pytest

from epd.stages.server_config import TransportSecurity
from epd.transport.internal_secrets import InternalSecrets, internal_secrets

OLD, NEW = secrets.token_hex(32), secrets.token_hex(32)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def swap_in(path, text: str) -> None:
    """A new file renamed over the old, as the kubelet updates a mounted Secret (a new inode)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_the_file_is_reread_when_it_changes_and_looked_at_once_per_interval(tmp_path):
    path = tmp_path / "secret"
    path.write_text(f"{OLD}\n")
    clock = Clock()
    followed = InternalSecrets((OLD,), str(path), check_interval_s=5, clock=clock)
    swap_in(path, f"{OLD}\n{NEW}\n")
    assert followed.current() == (OLD,)  # not looked at before the interval has passed
    clock.now_s = 5
    assert followed.current() == (OLD, NEW) and followed.presented == OLD
    swap_in(path, f"{NEW}\n{OLD}\n")  # the same size: the new inode tells
    clock.now_s = 10
    assert followed.current() == (NEW, OLD) and followed.presented == NEW
    path.write_text(f"{NEW}\n" + " " * (len(OLD) + 1))  # edited in place: the time and size tell
    clock.now_s = 15
    assert followed.current() == (NEW,)


@pytest.mark.parametrize("breakage", ["empty", "not a secret", "removed", "a directory"])
def test_a_file_that_becomes_unusable_keeps_the_secrets_and_is_logged_once(tmp_path, caplog, breakage):
    path = tmp_path / "secret"
    path.write_text(f"{NEW}\n{OLD}\n")
    clock = Clock()
    followed = InternalSecrets((NEW, OLD), str(path), check_interval_s=1, clock=clock)
    if breakage == "empty":
        swap_in(path, "\n")
    elif breakage == "not a secret":
        swap_in(path, "short\n")
    elif breakage == "removed":
        path.unlink()
    else:
        path.unlink()
        path.mkdir()
    with caplog.at_level(logging.ERROR, logger="epd.transport.internal_secrets"):
        for second in range(1, 4):
            clock.now_s = second
            assert followed.current() == (NEW, OLD)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"--internal-secret-file {path}" in errors[0]
    assert "keeping the internal secrets read before" in errors[0]
    if path.is_dir():
        path.rmdir()
    swap_in(path, f"{NEW}\n")  # fixed: followed again
    clock.now_s = 10
    assert followed.current() == (NEW,)


def test_a_service_shares_one_view_of_its_file_and_a_secret_without_a_file_is_fixed(tmp_path):
    path = tmp_path / "secret"
    path.write_text(f"{OLD}\n")
    security = TransportSecurity(internal_secret=OLD, internal_secret_file=str(path))
    # Its server's check and its channels' secret: one object, so they follow the file together.
    assert internal_secrets(security) is internal_secrets(
        TransportSecurity(internal_secret=OLD, internal_secret_file=str(path))
    )
    fixed = internal_secrets(TransportSecurity(internal_secret=OLD, previous_internal_secrets=(NEW,)))
    assert fixed.current() == (OLD, NEW) and fixed.path == ""
    assert internal_secrets(TransportSecurity()).presented == ""
    with pytest.raises(ValueError, match="an internal secret file needs the secrets read from it"):
        TransportSecurity(internal_secret_file=str(path))


def test_an_idle_server_follows_its_file_without_any_call(tmp_path, caplog):
    """A stage nobody calls still looks at its file every interval and logs the change: an
    operator's rotation waits for that line in every service's log before its next step
    (docs/security.md). The look came only with calls, and an idle gateway makes none now."""
    import asyncio
    import time

    from epd.stages.server_config import ServerConfig
    from epd.transport.server import create_server

    path = tmp_path / "secret"
    path.write_text(f"{OLD}\n")
    security = TransportSecurity(
        internal_secret=OLD, internal_secret_file=str(path), secret_check_interval_s=0.05
    )

    async def scenario() -> bool:
        hs = await create_server(
            ServerConfig(host="127.0.0.1", port=0, security=security), lambda s: None, []
        )
        try:
            swap_in(path, f"{OLD}\n{NEW}\n")
            deadline = time.monotonic() + 30.0  # a bound on a broken follow, not a timing assertion
            while time.monotonic() < deadline:
                if any("changed: now presenting" in r.getMessage() for r in caplog.records):
                    return True
                await asyncio.sleep(0.05)
            return False
        finally:
            await hs.stop(0)

    with caplog.at_level(logging.WARNING, logger="epd.transport.internal_secrets"):
        assert asyncio.run(scenario()), "the idle server never looked at its changed file"
