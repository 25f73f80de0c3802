"""Imported first by the stack's zygote (its first preload module, `epd.cli.zygote`): the zygote
ignores SIGTERM and SIGHUP, as multiprocessing's fork server already ignores SIGINT and its
resource tracker SIGINT and SIGTERM.

Why: a signal sent to the launcher's whole process group or cgroup (`kill -- -PGID`, `timeout`, a
closed terminal's SIGHUP, systemd's default KillMode=control-group) reached the zygote beside the
launcher. The zygote died, and with it (PR_SET_PDEATHSIG) every model service got SIGTERM at once:
the stages stopped taking calls before the gateway had drained (the ordered stop was lost), a
service stopping already took it as a second signal and cut its calls in flight, and a stack still
starting failed with a traceback (EOFError from the dead fork server). The zygote still ends when
the launcher's end of its pipe closes (a killed launcher too), and `Zygote.stop` kills it.
"""

from __future__ import annotations

import signal

INHERITED = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
"""The dispositions the zygote was started with (SIGHUP ignored under nohup): each forked service
gets them back before it does anything else."""

for _sig in INHERITED:
    signal.signal(_sig, signal.SIG_IGN)
