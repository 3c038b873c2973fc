"""Child processes that cannot outlive the process that started them.

A run is often ended by SIGKILL (a scheduler's time limit, a crashed node agent, a user).
A child started with plain subprocess then lives on with parent 1, holding memory and files
of a run that is gone. On Linux the kernel can deliver a signal to a child when the thread
that started it dies (prctl PR_SET_PDEATHSIG); run_child asks for SIGKILL.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, between fork and exec: ask for SIGKILL when the parent dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def run_child(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run(command, check=True, **kwargs), the child killed if this process dies
    (on Linux; elsewhere a plain subprocess.run)."""
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent
    return subprocess.run(command, check=True, **kwargs)
