"""Which checkpoint a restarted run resumes from, decided from its files before any rank loads
one: the newest finished checkpoint whose files are all as its save left them.

A checkpoint is written whole before `latest` names it, its manifest last
(orchestrator/checkpoints.py, orchestrator/manifest.py), but a file can still be damaged
afterwards: a disk that filled, a copy cut short, a node that lost power with writes in its
cache (a file of the right size full of zeros), bytes changed in place. Loading such a file
fails inside the ranks' collective load, some ranks raising and the others waiting on them, or
worse loads wrong weights without a word; so the first rank checks the candidates first:

    manifest.json           every file it lists there, of its size and hash
    controller.json         JSON of this step's controller state
    learner/                megatron's checkpoint files, readable and whole
                            (convert/dcp_files.py)
    rng/rank<r>.pt          one per rank of the run, each readable

and every rank resumes from what it chose (controller.settle: the choice is broadcast).

`latest` is read as a regular file only (never followed: a symlink, a loop or a directory there
is named and ignored); when it cannot be used, or is missing, every step directory is a
candidate. A step directory whose controller.json says it ends with a manifest and which has
none is a save that did not finish: never a candidate. Checkpoints written before manifests
(controller.json without the key) are used after the file checks alone, with a line saying
their bytes are unverified.

Nothing is deleted on resume. A damaged checkpoint newer than the chosen one is named with its
file and the reason, moved to checkpoints/corrupt/ (the reason may be worth a look) and counted
in the run's metrics; every other step directory newer than the chosen one (a save cut short,
or one `latest` never named) is moved to checkpoints/unfinished/, so a step is never written
over a half-written copy of itself. When no checkpoint is usable the run stops, naming each,
and nothing is moved. The two folders are never emptied by the run: remove them by hand. A
name of the run's own that something else holds is left as it is, in one line: a `corrupt`
or `unfinished` that is no directory (a file, a FIFO, a dangling symlink) makes the move go
to `corrupt.1` (the first free name), and a `latest` that is a directory is moved to
unfinished/ with what it holds before the pointer is written.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from megatron_fr.convert.dcp_files import megatron_checkpoint_problem, read_json
from megatron_fr.orchestrator.checkpoints import (
    LATEST,
    WRITES_MANIFEST,
    checkpoint_root,
    step_number,
    write_pointer,
)
from megatron_fr.orchestrator.manifest import MANIFEST, manifest_problem

CORRUPT_DIR = "corrupt"
UNFINISHED_DIR = "unfinished"


class NoUsableCheckpoint(RuntimeError):
    """The run directory has checkpoints and none can be resumed from."""


def checkpoint_problem(path: Path, world_size: int) -> str | None:
    """Why a run of `world_size` ranks cannot resume from the checkpoint `path`, naming the
    file; None if it can."""
    for problem in (
        manifest_problem(path) if os.path.lexists(path / MANIFEST) else None,
        _controller_problem(path),
        megatron_checkpoint_problem(path / "learner"),
        _rng_problem(path, world_size),
    ):
        if problem is not None:
            return problem
    return None


def _controller_problem(path: Path) -> str | None:
    state, problem = read_json(path / "controller.json")
    if problem is not None:
        return problem
    if not (
        isinstance(state, dict)
        and state.get("step") == step_number(path)
        and _is_rollout(state.get("rollout"))
    ):
        return f"{path / 'controller.json'}: not this checkpoint's controller state"
    return None


def finished(path: Path) -> bool:
    """Whether the save of step directory `path` finished: it has a manifest, or it was
    written before manifests (a controller.json without the key; its files are checked)."""
    if os.path.lexists(path / MANIFEST):
        return True
    state, problem = read_json(path / "controller.json")
    if problem is not None:
        return (path / "controller.json").exists()  # damaged, not unfinished: checked later
    return not (isinstance(state, dict) and state.get(WRITES_MANIFEST) is True)


def _is_rollout(state: object) -> bool:
    return isinstance(state, dict) and {"buffer", "completed", "failures"} <= state.keys()


def _rng_problem(path: Path, world_size: int) -> str | None:
    for rank in range(world_size):
        file = path / "rng" / f"rank{rank}.pt"
        if not file.is_file():
            return f"{file}: missing (each of the run's {world_size} ranks loads its own)"
        try:
            torch.load(file, weights_only=False)
        except Exception as error:  # whatever unpickling damaged bytes raises
            return f"{file}: unreadable ({type(error).__name__}: {error})"
    return None


def _pointed(run_dir: Path) -> tuple[int | None, str | None]:
    """The step `latest` names (a step directory there), or why it names none."""
    pointer = checkpoint_root(run_dir) / LATEST
    if pointer.is_symlink() or not pointer.is_file():  # is_symlink: a loop is never followed
        return None, f"{pointer}: not a regular file (a symlink or a directory?)"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        return None, f"{pointer}: unreadable ({error})"
    target = checkpoint_root(run_dir) / name
    if os.sep in name or step_number(target) is None:
        return None, f"{pointer}: names {name[:80]!r}, not a step directory of {target.parent}"
    return step_number(target), None


def resume_point(run_dir: Path, world_size: int) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint to resume from (None: a fresh start, or none usable) and each newer one
    that cannot be used, with why, newest first (module docstring). Considered: the finished
    step directories up to `latest`'s, newest first; all of them when `latest` is missing or
    unusable. A `latest` that names a directory whose save did not finish counts as damaged
    (it was named only once its manifest was written)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None, []
    pointer_there = os.path.lexists(root / LATEST)
    newest, problem = _pointed(run_dir) if pointer_there else (None, None)
    bad = [] if problem is None else [(root / LATEST, problem)]
    steps = {path: step_number(path) for path in root.iterdir()}
    candidates = sorted(
        (s, p) for p, s in steps.items() if s is not None and (newest is None or s <= newest)
    )
    for step, path in reversed(candidates):
        if not finished(path):
            if step == newest:
                bad.append((path, f"{path / MANIFEST}: missing, yet {LATEST} names it"))
            continue
        why = checkpoint_problem(path, world_size)
        if why is None:
            return path, bad
        bad.append((path, why))
    return None, bad


def none_usable(run_dir: Path, bad: list[tuple[Path, str]]) -> str:
    """The error of a run directory with checkpoints, none of which can be resumed from."""
    reasons = "; ".join(why for _, why in bad)
    return (
        f"no checkpoint of {run_dir} can be resumed from: {reasons} (move the checkpoints "
        "directory away to start afresh)"
    )


def settle_resume_point(run_dir: Path, world_size: int) -> tuple[str | None, int, str | None]:
    """The first rank's decision, to broadcast: (checkpoint to resume from, how many were set
    aside as damaged, the error when none is usable). Damaged checkpoints newer than the chosen
    one go to checkpoints/corrupt/, the other step directories newer than it to
    checkpoints/unfinished/ (one line each, naming the path and why), and `latest` then names
    the chosen one."""
    chosen, bad = resume_point(run_dir, world_size)
    skipped = sum(path.name != LATEST for path, _ in bad)
    if chosen is None and bad:
        return None, skipped, none_usable(run_dir, bad)
    # From here on `bad` is empty unless a checkpoint was chosen.
    name = chosen.name if chosen is not None else "any usable checkpoint"
    for path, why in bad:
        if path.name == LATEST:
            print(f"cannot use {why}; {LATEST} now names {name}", flush=True)
        else:
            moved = _set_aside(path, CORRUPT_DIR)
            print(f"checkpoint {path} cannot be resumed from: {why}; moved to {moved}", flush=True)
    floor = -1 if chosen is None else step_number(chosen)
    for path in _newer_than(run_dir, -1 if floor is None else floor):
        moved = _set_aside(path, UNFINISHED_DIR)
        print(f"checkpoint {path} moved to {moved}: {_unfinished_reason(path, name)}", flush=True)
    if chosen is not None:
        if not (chosen / MANIFEST).exists():
            print(
                f"checkpoint {chosen} has no {MANIFEST} (written before checkpoints carried one): "
                "its files are checked for their form only, not for changed bytes",
                flush=True,
            )
        if _pointed(run_dir)[0] != step_number(chosen):
            _point_at(chosen)
    return (str(chosen) if chosen else None), skipped, None


def _newer_than(run_dir: Path, floor: int) -> list[Path]:
    """The step directories after step `floor`, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    steps = {path: step_number(path) for path in root.iterdir()}
    return sorted(path for path, step in steps.items() if step is not None and step > floor)


def _unfinished_reason(path: Path, chosen: str) -> str:
    if (path / MANIFEST).exists():
        return f"written after {chosen}, which {LATEST} names"
    return f"no {MANIFEST}: a save that did not finish"


def _set_aside(path: Path, folder: str) -> Path:
    """Move `path` (a step directory, or whatever stood at `latest`) into checkpoints/<folder>/,
    never over an earlier one. When <folder> is there but is no directory (a regular file, a
    FIFO, a dangling symlink: nothing the run made), it is left as it is and the first free
    <folder>.<n> is used instead, with a line saying so: moving into it would fail, and
    clearing it would delete what someone put there."""
    holder = _folder(path.parent, folder)
    destination = holder / path.name
    suffix = 1
    while os.path.lexists(destination):
        destination, suffix = holder / f"{path.name}.{suffix}", suffix + 1
    shutil.move(str(path), str(destination))
    return destination


def _folder(root: Path, folder: str) -> Path:
    """checkpoints/<folder>, made if missing, or the first free or usable <folder>.<n> when
    that name is taken by something other than a directory."""
    candidate, suffix = root / folder, 0
    while os.path.lexists(candidate) and not candidate.is_dir():
        suffix += 1
        candidate = root / f"{folder}.{suffix}"
    if suffix:
        print(
            f"{root / folder} is not a directory ({_kind(root / folder)}): left as it is; "
            f"using {candidate} instead",
            flush=True,
        )
    candidate.mkdir(exist_ok=True)
    return candidate


def _kind(path: Path) -> str:
    """What stands at `path`, in words, for a line naming it."""
    if path.is_symlink():
        return "a symlink" if path.exists() else "a dangling or looping symlink"
    if path.is_dir():
        return "a directory"
    if path.is_file():
        return "a regular file"
    return "a FIFO, socket or device" if path.exists() else "missing"


def _point_at(checkpoint: Path) -> None:
    """Make `latest` name `checkpoint`. A directory standing there is moved to
    checkpoints/unfinished/ first with what it holds, never deleted (it was removed with
    shutil.rmtree); a symlink or a FIFO, which hold nothing, is replaced, as a pointer file
    that names no usable checkpoint is (resume_point named each already)."""
    pointer = checkpoint.parent / LATEST
    if pointer.is_dir() and not pointer.is_symlink():
        moved = _set_aside(pointer, UNFINISHED_DIR)
        print(f"{pointer} was a directory, not the pointer file: moved to {moved}", flush=True)
    write_pointer(checkpoint)
