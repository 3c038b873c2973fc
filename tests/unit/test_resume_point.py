"""Which checkpoint a restarted run resumes from: the newest one whose files are all readable,
decided from the files alone (before any rank loads anything); every newer one that is not is
named with its file and the reason, and set aside, never silently used or skipped.

The checkpoints are written as a run writes them: torch's distributed checkpoint (the format
megatron's torch_dist saves in, one torch.save archive per item), megatron's metadata.json,
each rank's RNG file, controller.json, the manifest last, then the `latest` pointer; and as a
version before manifests wrote them (`legacy`: no manifest, a controller.json without its key),
whose files are checked for their form alone."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.manifest import MANIFEST, write_manifest
from megatron_fr.orchestrator.resume import (
    NoUsableCheckpoint,
    checkpoint_problem,
    resume_point,
    settle_resume_point,
)


def write_checkpoint(run_dir: Path, step: int, legacy: bool = False, keep: int = 3) -> Path:
    path = ckpt.step_dir(run_dir, step)
    state = {"weight": torch.full((64, 8), float(step)), "steps_done": step, "bias": torch.ones(8)}
    dcp.save(state, checkpoint_id=str(path / "learner"), no_dist=True)
    (path / "learner" / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    for rank in range(2):
        ckpt.save_rng(path, rank)
    rollout = {"buffer": {}, "completed": 0, "failures": {}}
    if legacy:
        (path / "controller.json").write_text(json.dumps({"step": step, "rollout": rollout}))
    else:
        ckpt.save_controller_state(path, {"step": step, "rollout": rollout})
        write_manifest(path)
    ckpt.mark_latest(run_dir, path, keep=keep)
    return path


@pytest.fixture(params=[False, True], ids=["manifest", "legacy"])
def legacy(request) -> bool:
    return request.param


@pytest.fixture
def run_dir(tmp_path: Path, legacy: bool) -> Path:
    for step in (10, 20):
        write_checkpoint(tmp_path, step, legacy)
    return tmp_path


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def zero_fill(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def flip_64_bytes(path: Path) -> None:
    """64 bytes inverted in the middle of the file: same size, same framing."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


SHARD = "learner/__0_0.distcp"
SIZE, HASH, LISTED = "bytes, the manifest says", "differ from the manifest's hash", "manifest lists"
CORRUPTIONS = [  # name, file, damage, the reason without a manifest, the manifest's reason
    ("truncated shard", SHARD, truncate, "shorter than", SIZE),
    ("zero-filled shard", SHARD, zero_fill, "not a torch.save archive", HASH),
    ("missing shard", SHARD, Path.unlink, "missing", LISTED),
    ("truncated .metadata", "learner/.metadata", truncate, "unreadable", SIZE),
    ("zero-filled .metadata", "learner/.metadata", zero_fill, "unreadable", HASH),
    ("truncated metadata.json", "learner/metadata.json", truncate, "not readable JSON", SIZE),
    ("truncated controller.json", "controller.json", truncate, "not readable JSON", SIZE),
    (
        "controller.json of another step",
        "controller.json",
        lambda p: p.write_text(json.dumps({"step": 7, "rollout": {}})),
        "not this checkpoint's",
        SIZE,
    ),
    ("truncated RNG file", "rng/rank1.pt", truncate, "unreadable", SIZE),
    ("missing RNG file", "rng/rank1.pt", Path.unlink, "missing (each of the run's 2 ranks", LISTED),
    ("64 bytes flipped in a shard", SHARD, flip_64_bytes, None, HASH),
]


@pytest.mark.parametrize(
    ("name", "file", "corrupt", "reason", "manifest_reason"),
    CORRUPTIONS,
    ids=[c[0] for c in CORRUPTIONS],
)
def test_a_corrupt_newest_checkpoint_is_named_and_the_one_before_used(
    run_dir, legacy, name, file, corrupt, reason, manifest_reason
):
    """With a manifest every damage is named by it; without one (legacy) by the file checks,
    which cannot see bytes changed in place: that damage goes unseen."""
    newest = ckpt.step_dir(run_dir, 20)
    corrupt(newest / file)
    chosen, bad = resume_point(run_dir, 2)
    if legacy and reason is None:
        assert (chosen, bad) == (newest, [])
        return
    assert chosen == ckpt.step_dir(run_dir, 10)
    ((path, why),) = bad
    expected = reason if legacy else manifest_reason
    assert path == newest and str(newest / file) in why and expected in why, why


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


def test_random_byte_damage_to_the_newest_is_caught_or_harmless(run_dir, legacy):
    """Flipping random bytes anywhere in the newest checkpoint's files never makes the choice
    raise: it picks the older one, naming the damaged file, or (without a manifest only) the
    newest, when the damage is in a tensor's data, which the file checks cannot see."""
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
        unchanged = bytes(damaged) == original
        allowed = [ckpt.step_dir(run_dir, 10)]
        if legacy or unchanged:
            allowed.append(ckpt.step_dir(run_dir, 20))
        assert chosen in allowed and all(str(file) in why for _, why in bad), bad
        file.write_bytes(original)


def step_dirs(run_dir: Path, folder: str = "") -> list[str]:
    return sorted(p.name for p in (ckpt.checkpoint_root(run_dir) / folder).glob("step_*"))


def test_a_latest_symlink_loop_resumes_from_the_newest_and_keeps_every_checkpoint(tmp_path, capsys):
    """The issue's case: `latest` a symlink to itself, keep=100, three complete checkpoints.
    The loop is named, never followed; the newest is used and nothing moved or deleted."""
    for step in (2, 3, 4):
        write_checkpoint(tmp_path, step, keep=100)
    pointer = ckpt.checkpoint_root(tmp_path) / ckpt.LATEST
    pointer.unlink()
    pointer.symlink_to(ckpt.LATEST)
    newest = str(ckpt.step_dir(tmp_path, 4))
    assert settle_resume_point(tmp_path, 2) == (newest, 0, None)
    assert step_dirs(tmp_path) == ["step_00000002", "step_00000003", "step_00000004"]
    assert not pointer.is_symlink() and pointer.read_text() == "step_00000004\n"
    out = capsys.readouterr().out
    assert f"cannot use {pointer}: not a regular file" in out and "now names step_00000004" in out
    assert "deleted" not in out and "moved" not in out
    assert settle_resume_point(tmp_path, 2) == (newest, 0, None)  # and again, quietly
    assert capsys.readouterr().out == ""


def test_64_flipped_bytes_in_the_newest_shard_set_it_aside_and_resume_from_the_one_before(
    tmp_path, capsys
):
    """The issue's second case: the same size, bytes changed in place. The manifest's hash
    names the shard; the checkpoint is moved to corrupt/ with its files, not deleted."""
    for step in (2, 3, 4):
        write_checkpoint(tmp_path, step, keep=100)
    shard = ckpt.step_dir(tmp_path, 4) / SHARD
    size = shard.stat().st_size
    flip_64_bytes(shard)
    assert shard.stat().st_size == size
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 3)), 1, None)
    assert step_dirs(tmp_path) == ["step_00000002", "step_00000003"]
    assert step_dirs(tmp_path, "corrupt") == ["step_00000004"]
    kept = ckpt.checkpoint_root(tmp_path) / "corrupt" / "step_00000004" / SHARD
    assert kept.stat().st_size == size
    out = capsys.readouterr().out
    assert f"{shard}: its bytes differ from the manifest's hash" in out
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 3)


def test_a_save_cut_short_before_its_manifest_is_moved_aside_not_deleted(tmp_path, capsys):
    """A step directory after `latest` with every file but the manifest (killed between the
    two) is moved to unfinished/; the resume is from `latest`."""
    write_checkpoint(tmp_path, 10)
    cut = write_checkpoint(tmp_path, 20)
    (cut / MANIFEST).unlink()
    (ckpt.checkpoint_root(tmp_path) / ckpt.LATEST).write_text("step_00000010\n")
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 10)), 0, None)
    assert step_dirs(tmp_path) == ["step_00000010"]
    assert step_dirs(tmp_path, "unfinished") == ["step_00000020"]
    out = capsys.readouterr().out
    assert f"checkpoint {cut} moved to" in out and "a save that did not finish" in out


def test_a_first_save_cut_short_is_a_fresh_start_with_the_save_moved_aside(tmp_path):
    """No `latest` and no finished checkpoint: a fresh start, the partial save kept aside."""
    cut = ckpt.step_dir(tmp_path, 5)
    (cut / "learner").mkdir(parents=True)
    (cut / "learner" / "__0_0.distcp").write_bytes(b"half")
    assert settle_resume_point(tmp_path, 2) == (None, 0, None)
    assert step_dirs(tmp_path) == [] and step_dirs(tmp_path, "unfinished") == ["step_00000005"]


def test_a_missing_latest_resumes_from_the_newest_intact_checkpoint(tmp_path):
    """A deleted pointer no longer means a fresh start over complete checkpoints."""
    for step in (10, 20):
        write_checkpoint(tmp_path, step)
    (ckpt.checkpoint_root(tmp_path) / ckpt.LATEST).unlink()
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 20)), 0, None)
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 20)


def test_latest_naming_a_checkpoint_without_its_manifest_counts_as_damaged(tmp_path):
    """`latest` is marked after the manifest, so a missing one under it is damage."""
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    (newest / MANIFEST).unlink()
    chosen, bad = resume_point(tmp_path, 2)
    assert chosen == ckpt.step_dir(tmp_path, 10)
    assert bad == [(newest, f"{newest / MANIFEST}: missing, yet latest names it")]


def test_a_checkpoint_from_before_manifests_is_used_with_a_line_saying_so(tmp_path, capsys):
    path = write_checkpoint(tmp_path, 10, legacy=True)
    assert settle_resume_point(tmp_path, 2) == (str(path), 0, None)
    assert f"checkpoint {path} has no manifest.json" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("file", "reason"),
    [(SHARD, "not a regular file (the manifest lists a file)"), (MANIFEST, "not a regular file")],
)
def test_a_fifo_in_place_of_a_listed_file_or_the_manifest_is_named_without_blocking(
    tmp_path, file, reason
):
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    (newest / file).unlink()
    os.mkfifo(newest / file)
    chosen, bad = resume_point(tmp_path, 2)
    assert chosen == ckpt.step_dir(tmp_path, 10)
    assert bad == [(newest, f"{newest / file}: {reason}")]


def _make_a(kind: str, path: Path) -> bytes | None:
    """Put `kind` at `path` (what a run directory may hold where the run expects a folder
    or the pointer); the bytes it holds, to check it was kept, where it holds any."""
    if kind == "file":
        path.write_bytes(b"someone's notes\n")
        return path.read_bytes()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling symlink":
        path.symlink_to(path.parent / "gone")
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    return None


SHAPES = ["file", "fifo", "dangling symlink", "symlink loop"]


@pytest.mark.parametrize("folder", ["corrupt", "unfinished"])
@pytest.mark.parametrize("kind", SHAPES)
def test_a_set_aside_folder_taken_by_another_kind_is_kept_and_a_fresh_name_used(
    tmp_path, capsys, folder, kind
):
    """checkpoints/corrupt or unfinished that is no directory ended the start with a
    FileExistsError: now it is left as it is, the checkpoint goes to <folder>.1, one line."""
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    if folder == "corrupt":
        zero_fill(newest / SHARD)
    else:
        (ckpt.checkpoint_root(tmp_path) / ckpt.LATEST).write_text("step_00000010\n")
    taken = ckpt.checkpoint_root(tmp_path) / folder
    held = _make_a(kind, taken)
    chosen, skipped, error = settle_resume_point(tmp_path, 2)
    assert (chosen, skipped, error) == (str(ckpt.step_dir(tmp_path, 10)), folder == "corrupt", None)
    assert os.path.lexists(taken) and not taken.is_dir()
    if held is not None:
        assert taken.read_bytes() == held
    assert step_dirs(tmp_path, f"{folder}.1") == ["step_00000020"]
    assert (ckpt.checkpoint_root(tmp_path) / f"{folder}.1" / "step_00000020" / SHARD).is_file()
    out = capsys.readouterr().out
    assert f"{taken} is not a directory" in out and f"using {taken}.1 instead" in out
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 10)


def test_a_second_set_aside_folder_taken_too_moves_on_to_the_next_free_name(tmp_path):
    write_checkpoint(tmp_path, 10)
    zero_fill(write_checkpoint(tmp_path, 20) / SHARD)
    root = ckpt.checkpoint_root(tmp_path)
    (root / "corrupt").write_text("x")
    (root / "corrupt.1").write_text("y")
    assert settle_resume_point(tmp_path, 2)[0] == str(ckpt.step_dir(tmp_path, 10))
    assert step_dirs(tmp_path, "corrupt.2") == ["step_00000020"]
    assert (root / "corrupt").read_text() == "x" and (root / "corrupt.1").read_text() == "y"


def test_a_latest_that_is_a_directory_is_moved_aside_with_what_it_holds_never_deleted(
    tmp_path, capsys
):
    """_point_at removed such a directory with shutil.rmtree, and what it held with it."""
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20)
    pointer = ckpt.checkpoint_root(tmp_path) / ckpt.LATEST
    pointer.unlink()
    pointer.mkdir()
    (pointer / "keep.txt").write_text("precious")
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 20)), 0, None)
    assert pointer.read_text() == "step_00000020\n"
    moved = ckpt.checkpoint_root(tmp_path) / "unfinished" / ckpt.LATEST
    assert (moved / "keep.txt").read_text() == "precious"
    out = capsys.readouterr().out
    assert f"{pointer} was a directory, not the pointer file: moved to {moved}" in out


@pytest.mark.parametrize("kind", ["fifo", "dangling symlink"])
def test_a_latest_of_another_kind_is_named_and_replaced(tmp_path, capsys, kind):
    """A FIFO or a symlink holds nothing to keep: named, then replaced by the pointer."""
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20)
    pointer = ckpt.checkpoint_root(tmp_path) / ckpt.LATEST
    pointer.unlink()
    _make_a(kind, pointer)
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 20)), 0, None)
    assert not pointer.is_symlink() and pointer.read_text() == "step_00000020\n"
    assert f"cannot use {pointer}: not a regular file" in capsys.readouterr().out


def _empty_manifest(checkpoint: Path) -> None:
    (checkpoint / MANIFEST).write_text(
        json.dumps({"format": 1, "hash": "blake2b-128", "files": {}})
    )


@pytest.mark.parametrize("damage", [None, flip_64_bytes], ids=["intact", "flipped"])
def test_a_manifest_listing_no_files_of_a_checkpoint_that_has_some_counts_as_damaged(
    tmp_path, capsys, damage
):
    """With `files: {}` a bit-flipped shard resumed silently: the manifest vouched for
    nothing. A manifest that leaves out a file the resume loads is itself damage."""
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    _empty_manifest(newest)
    if damage is not None:
        damage(newest / SHARD)
    chosen, bad = resume_point(tmp_path, 2)
    assert chosen == ckpt.step_dir(tmp_path, 10)
    ((path, why),) = bad
    assert path == newest and "not listed in" in why and "(0 files listed)" in why
    assert settle_resume_point(tmp_path, 2) == (str(ckpt.step_dir(tmp_path, 10)), 1, None)
    assert step_dirs(tmp_path, "corrupt") == ["step_00000020"]


def test_a_manifest_missing_one_shard_names_that_shard(tmp_path):
    newest = write_checkpoint(tmp_path, 10)
    manifest = json.loads((newest / MANIFEST).read_text())
    del manifest["files"][SHARD]
    (newest / MANIFEST).write_text(json.dumps(manifest))
    ((_, why),) = resume_point(tmp_path, 2)[1]
    assert why.startswith(f"{newest / SHARD}: not listed in {newest / MANIFEST}")


def test_a_note_beside_the_loaded_files_needs_no_manifest_entry(tmp_path):
    newest = write_checkpoint(tmp_path, 10)
    (newest / "learner" / "notes.txt").write_text("an extra file")
    assert resume_point(tmp_path, 2) == (newest, [])


def test_marking_latest_works_with_a_directory_where_the_old_temporary_name_was(tmp_path):
    """A fixed `latest.partial` that was a directory failed the save after its checkpoint."""
    write_checkpoint(tmp_path, 10)
    (ckpt.checkpoint_root(tmp_path) / "latest.partial").mkdir()
    write_checkpoint(tmp_path, 20)
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 20)
    leftovers = [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir() if p.name.startswith(".")]
    assert leftovers == []
