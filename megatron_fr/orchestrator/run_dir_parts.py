"""The parts of an existing run directory, checked before a restart starts any process.

A run writes its files at fixed names; one of them of the wrong kind kills the run only when
it is first written, which for `checkpoints` is after the first steps have been trained (and
are then lost): `metrics.jsonl` a directory, `checkpoints` a file, a part that is a symlink
loop, or a directory's symlink to nothing. Each is one line naming the part, what it is and
what the run needs there, before anything starts. Parts that are absent are made by the run.
The live engines file (engines.txt) is not among them: what it holds, whatever its kind, is
never fatal (rollout/engines_file.py).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from megatron_fr.analysis.run_files import BATCHES_FILE, CONFIG_FILE, METRICS_FILE
from megatron_fr.orchestrator.sinks import TENSORBOARD_DIR

DIRECTORIES = ("checkpoints", "logs", TENSORBOARD_DIR)
"""Written into by the run: checkpoints (orchestrator/checkpoints.py), the engines' logs, the
TensorBoard events."""
FILES = (
    METRICS_FILE,
    CONFIG_FILE,
    BATCHES_FILE,  # orchestrator/report.py
    "faults.jsonl",  # rollout/supervisor.py
    "weight_groups.json",  # weights/sync.py
)
"""Written or appended to by the run."""


def check_run_dir_parts(run_dir: Path) -> None:
    """ValueError naming the first part of `run_dir` the run could not write (module
    docstring); nothing when all can be."""
    for name in DIRECTORIES + FILES:
        problem = _problem(run_dir / name, want_directory=name in DIRECTORIES)
        if problem is not None:
            raise ValueError(f"--run-dir: {run_dir / name} {problem}")


def _problem(path: Path, want_directory: bool) -> str | None:
    wanted = "a directory" if want_directory else "a regular file"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # absent, or a symlink to nothing: a file is made at its end
        if want_directory and os.path.islink(path):
            return "is a symlink to nothing: the run makes a directory there; remove it"
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"is a symlink loop: the run writes {wanted} there; remove it"
        return f"cannot be read ({error.strerror}): the run writes {wanted} there"
    if (stat.S_ISDIR if want_directory else stat.S_ISREG)(mode):
        return None
    found = "a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode) else "special"
    return f"is {found}, where the run writes {wanted}: move it away or choose another --run-dir"
