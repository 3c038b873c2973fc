"""Run-checkpoint pruning keeps `latest` and the newest complete checkpoints before it, whatever
half-written or abandoned step directories lie around (a kill mid-save, a resume from an
earlier checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fr.orchestrator import checkpoints as ckpt


def make_step(run_dir: Path, step: int, *, complete: bool) -> Path:
    """A step directory as a save leaves it: learner files, then controller.json last."""
    path = ckpt.step_dir(run_dir, step)
    (path / "learner").mkdir(parents=True)
    (path / "learner" / "__0_0.distcp").write_bytes(b"x")
    if complete:
        ckpt.save_controller_state(path, {"step": step})
    return path


def remaining(run_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in ckpt.checkpoint_root(run_dir).glob("step_*"))


def test_keep_1_never_deletes_the_checkpoint_just_marked_latest(tmp_path):
    """A higher-numbered half-written step (killed mid-save before a resume from step 10) must
    not count as the newest: sorting by number alone would keep it and delete step 15."""
    make_step(tmp_path, 10, complete=True)
    make_step(tmp_path, 20, complete=False)
    current = make_step(tmp_path, 15, complete=True)

    ckpt.mark_latest(tmp_path, current, keep=1)

    assert remaining(tmp_path) == [15]
    assert ckpt.latest_checkpoint(tmp_path) == current


def test_keep_n_counts_complete_older_checkpoints_only(tmp_path):
    for step in (5, 10):
        make_step(tmp_path, step, complete=True)
    make_step(tmp_path, 12, complete=False)  # an interrupted save
    make_step(tmp_path, 30, complete=True)  # complete, but of the run abandoned at resume
    make_step(tmp_path, 40, complete=False)
    current = make_step(tmp_path, 20, complete=True)
    (ckpt.checkpoint_root(tmp_path) / "notes").mkdir()  # not a step directory: untouched

    ckpt.mark_latest(tmp_path, current, keep=2)

    assert remaining(tmp_path) == [10, 20]
    assert (ckpt.checkpoint_root(tmp_path) / "notes").is_dir()
    assert ckpt.latest_checkpoint(tmp_path) == current


def test_plain_rotation_and_bad_keep(tmp_path):
    for step in (1, 2, 3):
        ckpt.mark_latest(tmp_path, make_step(tmp_path, step, complete=True), keep=2)
    assert remaining(tmp_path) == [2, 3]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        ckpt.checkpoints_to_prune(tmp_path, ckpt.step_dir(tmp_path, 3), keep=0)
