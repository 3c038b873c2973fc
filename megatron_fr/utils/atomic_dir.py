"""Write a directory so that it appears complete or not at all.

Work happens in a hidden sibling (same file system, so the final rename is atomic); on any
failure, Ctrl-C included, the partial directory is removed and nothing exists at the target.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def refuse_existing(target: str | Path) -> Path:
    """The target as a Path; FileExistsError if something is already there (never overwrite)."""
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists; remove it or choose another output path")
    return target


@contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``target`` when the block succeeds."""
    target = refuse_existing(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.rename(partial, target)
