"""Which checkpoint a restarted run resumes from: the newest one whose files are all readable,
decided from the files alone (before any rank loads anything); every newer one that is not is
named with its file and the reason, and set aside, never silently used or skipped.

The checkpoints are written as a run writes them: torch's distributed checkpoint (the format
megatron's torch_dist saves in, one torch.save archive per item), megatron's metadata.json,
each rank's RNG file, controller.json last, then the `latest` pointer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.resume import (
    NoUsableCheckpoint,
    checkpoint_problem,
    resume_point,
    settle_resume_point,
)


def write_checkpoint(run_dir: Path, step: int) -> Path:
    path = ckpt.step_dir(run_dir, step)
    state = {"weight": torch.full((64, 8), float(step)), "steps_done": step, "bias": torch.ones(8)}
    dcp.save(state, checkpoint_id=str(path / "learner"), no_dist=True)
    (path / "learner" / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    for rank in range(2):
        ckpt.save_rng(path, rank)
    rollout = {"buffer": {}, "completed": 0, "failures": {}}
    ckpt.save_controller_state(path, {"step": step, "rollout": rollout})
    ckpt.mark_latest(run_dir, path, keep=3)
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    for step in (10, 20):
        write_checkpoint(tmp_path, step)
    return tmp_path


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


SHARD = "learner/__0_0.distcp"
CORRUPTIONS = [
    ("truncated shard", SHARD, truncate, "shorter than"),
    ("zero-filled shard", SHARD, zero_fill, "not a torch.save archive"),
    ("missing shard", SHARD, Path.unlink, "missing"),
    ("truncated .metadata", "learner/.metadata", truncate, "unreadable"),
    ("zero-filled .metadata", "learner/.metadata", zero_fill, "unreadable"),
    ("truncated metadata.json", "learner/metadata.json", truncate, "not readable JSON"),
    ("truncated controller.json", "controller.json", truncate, "not readable JSON"),
    (
        "controller.json of another step",
        "controller.json",
        lambda p: p.write_text(json.dumps({"step": 7, "rollout": {}})),
        "not this checkpoint's",
    ),
    ("truncated RNG file", "rng/rank1.pt", truncate, "unreadable"),
    ("missing RNG file", "rng/rank1.pt", Path.unlink, "missing (each of the run's 2 ranks"),
]


@pytest.mark.parametrize(
    ("name", "file", "corrupt", "reason"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS]
)
def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_used(
    run_dir, name, file, corrupt, reason
):
    newest = ckpt.step_dir(run_dir, 20)
    corrupt(newest / file)
    chosen, bad = resume_point(run_dir, 2)
    assert chosen == ckpt.step_dir(run_dir, 10)
    ((path, why),) = bad
    assert path == newest and str(newest / file) in why and reason in why, why


def test_a_complete_newest_checkpoint_is_used_and_an_older_bad_one_is_not_looked_at(run_dir):
    zero_fill(ckpt.step_dir(run_dir, 10) / SHARD)
    assert resume_point(run_dir, 2) == (ckpt.step_dir(run_dir, 20), [])
    assert checkpoint_problem(ckpt.step_dir(run_dir, 20), 2) is None


def test_settling_sets_the_bad_one_aside_and_points_latest_at_the_one_used(run_dir, capsys):
    newest = ckpt.step_dir(run_dir, 20)
    truncate(newest / SHARD)
    assert settle_resume_point(run_dir, 2) == (str(ckpt.step_dir(run_dir, 10)), 1, None)
    assert (
        not newest.exists() and (ckpt.checkpoint_root(run_dir) / "corrupt" / newest.name).is_dir()
    )
    assert ckpt.latest_checkpoint(run_dir) == ckpt.step_dir(run_dir, 10)
    out = capsys.readouterr().out
    assert f"{newest} cannot be resumed from: {newest / SHARD}" in out
    assert settle_resume_point(run_dir, 2) == (str(ckpt.step_dir(run_dir, 10)), 0, None)


@pytest.mark.parametrize("pointer", ["", "step_00000099\n", "../../etc\n", "\x00\xff"])
def test_an_unusable_latest_pointer_is_named_and_the_newest_complete_one_used(run_dir, pointer):
    (ckpt.checkpoint_root(run_dir) / ckpt.LATEST).write_text(pointer, errors="surrogateescape")
    chosen, bad = resume_point(run_dir, 2)
    assert chosen == ckpt.step_dir(run_dir, 20)
    ((path, why),) = bad
    assert path == ckpt.checkpoint_root(run_dir) / ckpt.LATEST and "latest" in why


def test_no_usable_checkpoint_is_an_error_naming_each_and_nothing_is_moved(run_dir):
    for step in (10, 20):
        zero_fill(ckpt.step_dir(run_dir, step) / SHARD)
    path, skipped, error = settle_resume_point(run_dir, 2)
    assert path is None and skipped == 2
    assert "step_00000020" in error and "step_00000010" in error and "\n" not in error
    assert ckpt.step_dir(run_dir, 20).is_dir()
    with pytest.raises(NoUsableCheckpoint):
        raise NoUsableCheckpoint(error)


def test_a_fresh_run_directory_has_nothing_to_resume(tmp_path):
    assert resume_point(tmp_path, 2) == (None, [])
    assert settle_resume_point(tmp_path, 2) == (None, 0, None)


def test_random_byte_damage_to_the_newest_is_caught_or_harmless(run_dir):
    """Flipping random bytes anywhere in the newest checkpoint's files never makes the choice
    raise: it picks the newest (damage in a tensor's data, which no check can see) or the
    older one, naming the damaged file."""
    rng = random.Random(0)
    files = sorted(p for p in ckpt.step_dir(run_dir, 20).rglob("*") if p.is_file())
    for _ in range(30):
        file = rng.choice(files)
        original = file.read_bytes()
        damaged = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        file.write_bytes(bytes(damaged))
        chosen, bad = resume_point(run_dir, 2)
        assert chosen in (ckpt.step_dir(run_dir, 20), ckpt.step_dir(run_dir, 10))
        assert all(str(file) in why for _, why in bad), bad
        file.write_bytes(original)
