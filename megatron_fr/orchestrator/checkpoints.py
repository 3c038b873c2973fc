"""Run checkpoints: where they live, which one is the latest, and the controller's state.

    RUN_DIR/checkpoints/step_00000010/learner/      model + optimizer + LR schedule (all ranks)
                                      rng/rank<r>.pt  each rank's RNG states
                                      controller.json step, version, buffer, prompt cursor
                                      manifest.json   every file's size and hash, written last
    RUN_DIR/checkpoints/latest                        name of the newest COMPLETE checkpoint

``latest`` is replaced (write + rename) only after every rank has finished writing and the
manifest is on the disk (orchestrator/manifest.py), so a run killed at any moment resumes from
a complete checkpoint. On resume, the per-step logs are cut back to that checkpoint's step: the
steps after it are trained again, and numbered again.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch

LATEST = "latest"
WRITES_MANIFEST = "writes_manifest"
"""The controller.json key (true) that marks a checkpoint whose save ends with a manifest:
without one, its save did not finish. Checkpoints written before manifests lack the key."""
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_root(run_dir) / LATEST
    if not pointer.exists():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    if not (path / "controller.json").exists():
        raise FileNotFoundError(f"{pointer} names {path}, which is incomplete")
    return path


def step_number(path: Path) -> int | None:
    """The step of a step directory (None for anything else)."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


def checkpoints_to_prune(run_dir: Path, latest: Path, keep: int) -> list[Path]:
    """The step directories to delete once `latest` is marked: all but `latest` itself and the
    `keep` - 1 newest COMPLETE checkpoints of earlier steps.

    Ordered by completeness first, then by step: a directory without controller.json is a
    save a kill interrupted, and one numbered after `latest` belongs to the run that was
    killed before this one resumed from an earlier checkpoint (it will be written again);
    neither may push a complete checkpoint, least of all `latest`, out of the kept set.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the latest checkpoint is always kept), got {keep}")
    root = checkpoint_root(run_dir)
    numbers = {path.name: step_number(path) for path in root.iterdir()}
    steps = {name: step for name, step in numbers.items() if step is not None}
    latest_step = steps[latest.name]
    older = [
        n for n, s in steps.items() if s < latest_step and (root / n / "controller.json").exists()
    ]
    kept = {latest.name, *sorted(older, key=steps.__getitem__, reverse=True)[: keep - 1]}
    return sorted(root / name for name in steps if name not in kept)


def mark_latest(run_dir: Path, checkpoint: Path, keep: int) -> None:
    """Point `latest` at checkpoint (atomically), then delete what checkpoints_to_prune names."""
    write_pointer(checkpoint)
    for old in checkpoints_to_prune(run_dir, checkpoint, keep):
        shutil.rmtree(old, ignore_errors=True)


def write_pointer(checkpoint: Path) -> None:
    """Make `latest` name `checkpoint`, atomically: the name goes to a temporary file of a name
    no one else uses (a fixed `latest.partial` could be a directory left there, and the write
    would fail after a whole checkpoint was saved), which is then renamed over `latest`."""
    handle, partial = tempfile.mkstemp(
        prefix=f".{LATEST}.", suffix=".partial", dir=checkpoint.parent
    )
    try:
        with os.fdopen(handle, "w") as file:
            file.write(checkpoint.name + "\n")
        os.replace(partial, checkpoint.parent / LATEST)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def save_rng(checkpoint: Path, rank: int) -> None:
    (checkpoint / "rng").mkdir(parents=True, exist_ok=True)
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save(state, checkpoint / "rng" / f"rank{rank}.pt")


def load_rng(checkpoint: Path, rank: int) -> None:
    state = torch.load(checkpoint / "rng" / f"rank{rank}.pt", weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_controller_state(checkpoint: Path, state: dict) -> None:
    partial = checkpoint / "controller.json.partial"
    partial.write_text(json.dumps(state | {WRITES_MANIFEST: True}))
    os.replace(partial, checkpoint / "controller.json")


def load_controller_state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "controller.json").read_text())


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the lines of a per-step log whose step is <= last_step (and drop a torn last line)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a kill cut short
        if record.get("step", 0) <= last_step:
            kept.append(line)
    partial = path.with_suffix(".partial")
    partial.write_text("".join(f"{line}\n" for line in kept))
    os.replace(partial, path)
