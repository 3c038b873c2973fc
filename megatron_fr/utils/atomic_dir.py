"""Write a directory so that it appears complete or not at all.

Work happens in a hidden sibling ``.NAME.partial-PID`` (same file system, so the final rename
is atomic); on any failure, Ctrl-C included, it is removed and nothing exists at the target.

A process killed outright (SIGKILL, OOM killer, lost node) cannot clean up after itself. So
before making its partial directory it writes an owner record beside it,
``.NAME.partial-PID.owner`` (JSON: pid, the process's start time, host), and the next
``atomic_directory`` for the same target removes the partial directories whose record names a
process of this host that is no longer running, and says so on stderr. Partial directories
without a record (not made here), or owned by a live process or another host (whose processes
cannot be checked from here), are left alone, and that is said too. The record sits beside the
directory rather than inside it because the directory becomes the output as it is (and megatron's
dist_checkpointing warns when it saves into a directory that is not empty).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

OWNER_SUFFIX = ".owner"


def refuse_existing(target: str | Path) -> Path:
    """The target as a Path; FileExistsError if something is already there (never overwrite)."""
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists; remove it or choose another output path")
    return target


def _process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc); None where unknown.

    A pid is reused once its process is gone; the start time tells the two apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after "(comm)"


def _is_running(pid: int, start_time: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    current = _process_start_time(pid)
    return start_time is None or current is None or current == start_time


def _partial_prefix(target: Path) -> str:
    return f".{target.name}.partial-"


def _owner_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "start_time": _process_start_time(pid), "host": socket.gethostname()}


def _say(message: str) -> None:
    print(f"atomic_directory: {message}", file=sys.stderr, flush=True)


def _stale_owner(record_path: Path) -> dict | None:
    """The owner record if its process is gone (on this host), else None."""
    try:
        record = json.loads(record_path.read_text())
        pid, host = int(record["pid"]), record["host"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or _is_running(pid, record.get("start_time")):
        return None
    return record


def remove_stale_partials(target: str | Path) -> list[Path]:
    """Remove the partial directories of `target` left by dead processes of this host (see
    the module docstring); returns what was removed. Everything else is left in place."""
    target = Path(target)
    if not target.parent.is_dir():
        return []
    prefix, removed = _partial_prefix(target), []
    for path in sorted(target.parent.iterdir()):
        if not path.name.startswith(prefix) or path.name.endswith(OWNER_SUFFIX):
            continue
        record_path = path.with_name(path.name + OWNER_SUFFIX)
        record = _stale_owner(record_path) if record_path.exists() else None
        if record is None:
            why = "owner is running or on another host" if record_path.exists() else "no owner"
            _say(f"left {path} in place ({why} record; remove it by hand if it is stale)")
            continue
        shutil.rmtree(path, ignore_errors=True)
        record_path.unlink(missing_ok=True)
        removed.append(path)
        _say(
            f"removed {path}, the partial output of process {record['pid']} on "
            f"{record['host']}, which is no longer running"
        )
    for record_path in target.parent.glob(f"{prefix}*{OWNER_SUFFIX}"):
        orphan = not record_path.with_name(record_path.name[: -len(OWNER_SUFFIX)]).exists()
        if orphan and _stale_owner(record_path) is not None:
            record_path.unlink(missing_ok=True)  # killed between writing it and mkdir
    return removed


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``target`` when the block succeeds."""
    target = refuse_existing(target)
    partial = target.parent / f"{_partial_prefix(target)}{os.getpid()}"
    record_path = partial.with_name(partial.name + OWNER_SUFFIX)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(target)
        record_path.write_text(json.dumps(_owner_record()))
    except OSError as error:
        raise OSError(error.errno, f"cannot write {target}: {error.strerror}") from None
    shutil.rmtree(partial, ignore_errors=True)  # this very process's own earlier attempt
    partial.mkdir()
    try:
        yield partial
        refuse_existing(target)  # another writer finished first (rename would replace an empty dir)
        os.rename(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        record_path.unlink(missing_ok=True)
