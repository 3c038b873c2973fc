"""What `megatron-fr train` checks of its environment before it starts any process: how it was
launched, the run directory, the checkpoints a restart would resume from, the engines a recipe
names. Each problem is a ValueError naming the variable, path or setting, the reason and what
to do (the recipe itself: orchestrator/check.py).
"""

from __future__ import annotations

import errno
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator.run_dir_parts import check_run_dir_parts

VIRTUAL_FILE_SYSTEMS = ("/proc", "/sys", "/dev")
TORCHRUN_MARKER = "TORCHELASTIC_RUN_ID"
"""Set by torchrun in every process it starts (srun starts torchrun in the Slurm jobs)."""
STORAGE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def _variable(name: str) -> int:
    text = os.environ.get(name)
    if text is None or not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a non-negative integer (set by torchrun)")
    return int(text)


def launch_environment() -> tuple[int, int] | None:
    """(rank, world size) of a process torchrun started; None for a command started by hand.
    Launcher variables set otherwise are refused: a process given WORLD_SIZE=2 by hand waits
    for a peer nobody started, at the rendezvous, for the whole collective timeout."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    world = _variable("WORLD_SIZE")
    if world < 1:
        raise ValueError(f"WORLD_SIZE={world}: must be at least 1")
    rank = _variable("RANK")
    if rank >= world:
        raise ValueError(f"RANK={rank} is not below WORLD_SIZE={world}")
    if world > 1 and TORCHRUN_MARKER not in os.environ:
        raise ValueError(
            f"WORLD_SIZE={world} and RANK={rank} are set, but not by torchrun (no "
            f"{TORCHRUN_MARKER}): this process would wait for peers nobody started. Unset them "
            "and `megatron-fr train` starts its own ranks, or start it under torchrun"
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(f"{name} is not set (WORLD_SIZE={world} is): start under torchrun")
    return rank, world


def check_run_dir(run_dir: Path) -> None:
    """A run directory this command can create and write: on storage (not /proc), under a
    directory, and without a STOP that is not a file (it would stop every start)."""
    if "\x00" in str(run_dir):
        raise ValueError(f"--run-dir {str(run_dir)!r}: a path cannot hold a NUL byte")
    try:
        resolved = run_dir.resolve()
        exists = run_dir.exists()
        ancestor = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    except RuntimeError:  # Path.resolve on a loop
        raise ValueError(f"--run-dir {run_dir}: a symlink loop; remove it") from None
    except OSError as error:
        raise ValueError(f"--run-dir {run_dir}: {error.strerror}") from None
    virtual = next((root for root in VIRTUAL_FILE_SYSTEMS if resolved.is_relative_to(root)), None)
    if virtual is not None:
        raise ValueError(
            f"--run-dir {run_dir} is under {virtual}, a virtual file system, not "
            "storage: choose a directory on disk"
        )
    if exists and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} exists and is not a directory")
    if not ancestor.is_dir():
        raise ValueError(f"--run-dir {run_dir}: {ancestor} is not a directory")
    try:
        handle, probe = tempfile.mkstemp(dir=ancestor, prefix=".megatron-fr-probe-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"--run-dir {run_dir}: cannot write in {ancestor} ({error.strerror})"
        ) from None
    check_run_dir_parts(run_dir)
    stop = run_dir / "STOP"
    if stop.exists() and not stop.is_file():
        raise ValueError(
            f"{stop} is not a file (a STOP file asks a run to stop after the "
            "step it is on; this one would stop every start): remove it"
        )


def check_resume(run_dir: Path, world_size: int) -> None:
    """A run directory with checkpoints has one to resume from (which one, and setting the
    unusable newer ones aside, is the first rank's job: orchestrator/resume.py)."""
    from megatron_fr.orchestrator.resume import none_usable, resume_point

    chosen, bad = resume_point(run_dir, world_size)
    if chosen is None and bad:
        raise ValueError(f"--run-dir: {none_usable(run_dir, bad)}")


def check_engines(config: RunConfig, poll_s: float = 1.0, report_every_s: float = 10.0) -> None:
    """Every engine the recipe names answers GET /health within
    rollout.engine.start_timeout_s (one still starting is waited for, as the run would), with
    a line on stderr at its first failure and every `report_every_s` after it, so a wait for
    an engine that never answers is seen at once (the URLs' form is the config's check)."""
    from megatron_fr.engine.http import EngineRequestError, get_json
    from megatron_fr.engine.types import HEALTH_PATH

    settings = config.rollout.engine
    started = time.monotonic()
    deadline = started + settings.start_timeout_s
    for url in settings.urls:
        reported = -math.inf
        while True:
            try:
                get_json(url, HEALTH_PATH, min(10.0, settings.start_timeout_s))
                break
            except EngineRequestError as error:
                now = time.monotonic()
                if now >= deadline:
                    raise ValueError(
                        f"rollout.engine.urls: {url} has not answered GET {HEALTH_PATH} within "
                        f"rollout.engine.start_timeout_s={settings.start_timeout_s:g} s ({error})"
                    ) from None
                if now - reported >= report_every_s:
                    reported = now
                    print(
                        f"waiting for the engine {url} to answer GET {HEALTH_PATH}: "
                        f"{now - started:.0f} s of rollout.engine.start_timeout_s="
                        f"{settings.start_timeout_s:g} s ({error})",
                        file=sys.stderr,
                        flush=True,
                    )
            time.sleep(poll_s)


def describe_storage_error(error: BaseException, run_dir: Path) -> str | None:
    """One line for a run that failed on its storage (disk full, quota, read-only): the file,
    or the run directory and its free space when the error names none; None for other
    errors. Looks through the causes, as libraries wrap OSError in their own errors."""
    cause: BaseException | None = error
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in STORAGE_ERRORS):
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, OSError):
        return None
    try:
        stats = os.statvfs(run_dir)
        free = f" ({stats.f_bavail * stats.f_frsize / 2**30:.1f} GiB free there)"
    except OSError:
        free = ""
    return (
        f"{cause.filename or run_dir}: {cause.strerror}{free}; once that is fixed, the same "
        "command resumes the run from its last checkpoint"
    )
