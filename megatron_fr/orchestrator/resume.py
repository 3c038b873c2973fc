"""Which checkpoint a restarted run resumes from, decided from its files before any rank loads
one: the newest whose files are all readable.

A checkpoint is written whole before `latest` names it (orchestrator/checkpoints.py), but a
file can still be damaged afterwards: a disk that filled, a copy cut short, a node that lost
power with writes in its cache (a file of the right size full of zeros). Loading such a file
fails inside the ranks' collective load, some ranks raising and the others waiting on them; so
the first rank checks the candidates file by file, without reading the tensors:

    controller.json         JSON of this step's controller state
    learner/                megatron's checkpoint files, readable and whole
                            (convert/dcp_files.py)
    rng/rank<r>.pt          one per rank of the run, each readable

and every rank resumes from what it chose (controller.settle: the choice is broadcast). A bad
checkpoint newer than the chosen one is named with its file and the reason, moved to
checkpoints/corrupt/ (not deleted: the reason may be worth a look) and counted in the run's
metrics; when no checkpoint is usable the run stops, naming each, and nothing is moved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from megatron_fr.convert.dcp_files import megatron_checkpoint_problem, read_json
from megatron_fr.orchestrator.checkpoints import LATEST, checkpoint_root, step_number

CORRUPT_DIR = "corrupt"


class NoUsableCheckpoint(RuntimeError):
    """The run directory has checkpoints and none can be resumed from."""


def checkpoint_problem(path: Path, world_size: int) -> str | None:
    """Why a run of `world_size` ranks cannot resume from the checkpoint `path`, naming the
    file; None if it can."""
    for problem in (
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
    that cannot be used, with why, newest first. Considered: `latest`'s step directory and
    the older ones, newest first; every step directory when `latest` is unusable; nothing
    without `latest` (no checkpoint was ever completed)."""
    root = checkpoint_root(run_dir)
    if not (root / LATEST).exists():
        return None, []
    newest, problem = _pointed(run_dir)
    bad = [] if problem is None else [(root / LATEST, problem)]
    steps = {path: step_number(path) for path in root.iterdir()}
    candidates = sorted(
        (s, p) for p, s in steps.items() if s is not None and (newest is None or s <= newest)
    )
    for _, path in reversed(candidates):
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
    aside, the error when none is usable). Bad checkpoints newer than the chosen one are
    reported and moved to checkpoints/corrupt/, and `latest` then names the chosen one."""
    chosen, bad = resume_point(run_dir, world_size)
    if not bad:
        return (str(chosen) if chosen else None), 0, None
    skipped = sum(path.name != LATEST for path, _ in bad)
    if chosen is None:
        return None, skipped, none_usable(run_dir, bad)
    for path, why in bad:
        if path.name == LATEST:
            print(f"cannot use {why}; {LATEST} now names {chosen.name}", flush=True)
        else:
            moved = _set_aside(path)
            print(f"checkpoint {path} cannot be resumed from: {why}; moved to {moved}", flush=True)
    _point_at(chosen)
    return str(chosen), skipped, None


def _set_aside(path: Path) -> Path:
    destination = path.parent / CORRUPT_DIR / path.name
    suffix = 1
    while destination.exists():
        destination, suffix = path.parent / CORRUPT_DIR / f"{path.name}.{suffix}", suffix + 1
    destination.parent.mkdir(exist_ok=True)
    shutil.move(str(path), str(destination))
    return destination


def _point_at(checkpoint: Path) -> None:
    pointer = checkpoint.parent / LATEST
    if pointer.is_dir():
        shutil.rmtree(pointer)
    partial = pointer.with_suffix(".partial")
    partial.write_text(checkpoint.name + "\n")
    os.replace(partial, pointer)
