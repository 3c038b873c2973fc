"""What is left of a sandbox run, read from /proc: the parent's checks that nothing of a run
survives (sandbox.py), and the count RLIMIT_NPROC sees for a uid."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _proc_entries() -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    return []


def processes_of(uid: int) -> list[int]:
    """PIDs whose real uid is `uid` and that are not zombies, from /proc."""
    found = []
    for pid in _proc_entries():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # exited while we looked
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            found.append(int(pid))
    return found


def group_members(pgid: int) -> list[int]:
    """PIDs of process group `pgid` that are not zombies, from /proc."""
    members = []
    for pid in _proc_entries():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(pid))
    return members


def tasks_of(uid: int) -> int:
    """Threads of `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    for pid in processes_of(uid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/task"))
    return total


def exited(pid: int) -> bool:
    """Whether child `pid` has exited, without reaping it."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None
