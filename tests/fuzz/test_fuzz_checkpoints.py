"""Fuzz of a run's checkpoints as a restart finds them: the files of the newest checkpoint of a
real run (2 learner ranks, the CPU engine) cut short, zero-filled, deleted, overwritten or
replaced by a directory or a FIFO, 64 bytes flipped in a shard, a broken `latest` pointer
(a symlink loop among them), both checkpoints broken, and harmless changes. The first rank's
resume decision (orchestrator/resume.py) must name the bad file and resume from the newest
usable checkpoint (or stop, naming each, when none is), never raise, hang or resume from a bad
one. Then the real command resumes a run whose `latest` is a symlink loop and whose newest
shard is zero-filled, and finishes it (tests/fuzz/fuzz_harness.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from fuzz_harness import REPO, Case, assert_sound, report, run_case

from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.resume import resume_point, settle_resume_point

SEED = 33
RUN = [
    "checkpoint.every_steps=1",
    "checkpoint.keep=3",
    "eval.problems=4",
    "eval.samples=1",
    "eval.every_steps=0",
    "buffer.batch_size=8",
    "buffer.capacity=16",
    "buffer.max_in_flight=8",
    "task.max_new_tokens=8",
    "rollout.engine.watch_interval_s=0.5",
]
FILES = [
    "controller.json",
    "learner/.metadata",
    "learner/metadata.json",
    "learner/__0_0.distcp",
    "learner/__1_0.distcp",
    "rng/rank0.pt",
    "rng/rank1.pt",
]


def train(ws: Path, run_dir: Path, steps: int) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "megatron_fr",
        "train",
        str(ws / "recipe.yaml"),
        "--run-dir",
        str(run_dir),
        f"steps={steps}",
        *RUN,
    ]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def resume_decision(argv: list[str]) -> int:
    """The first rank's decision on run directory argv[0], expected to resume from argv[1]
    ("-": from none): 0 when it resumes from the newest checkpoint with nothing to report, 2
    when it reported (and set aside) something or has no usable checkpoint; AssertionError
    when it chose another checkpoint than the newest usable one."""
    run_dir, expected = Path(argv[0]), None if argv[1] == "-" else Path(argv[1])
    _, bad = resume_point(run_dir, 2)  # the run's learner ranks
    chosen, _, error = settle_resume_point(run_dir, 2)
    if error is not None:
        print(f"error: {error}")
    chosen = Path(chosen) if chosen else None
    assert chosen == expected, f"resumed from {chosen}, expected {expected}"
    return 2 if bad or error else 0


def truncate(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(0, max(len(data) - 1, 1))])


def zero_fill(path: Path, rng: random.Random) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def scramble(path: Path, rng: random.Random) -> None:
    path.write_bytes(rng.randbytes(path.stat().st_size))


def delete(path: Path, rng: random.Random) -> None:
    path.unlink()


def flip_64_bytes(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    start = rng.randrange(0, len(data) - 64)
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])
    path.write_bytes(bytes(data))


def a_directory(path: Path, rng: random.Random) -> None:
    path.unlink()
    path.mkdir()


def a_fifo(path: Path, rng: random.Random) -> None:
    path.unlink()
    os.mkfifo(path)


class Runs:
    """Copies of the pristine run directory, one per case."""

    def __init__(self, pristine: Path, root: Path) -> None:
        self.pristine, self.root, self.count = pristine, root, 0

    def copy(self) -> Path:
        self.count += 1
        run_dir = self.root / f"case_{self.count:03d}"
        shutil.copytree(self.pristine, run_dir, symlinks=True)
        return run_dir


def decide(run_dir: Path, expected: Path | None, names: str | None, what: str) -> Case:
    argv = [str(run_dir), str(expected) if expected else "-"]
    return Case(what, argv, names, watch=run_dir)


def file_cases(runs: Runs, rng: random.Random) -> list[Case]:
    cases = []
    for file in FILES:
        for damage in (truncate, zero_fill, scramble, delete, a_directory):
            if damage is scramble and file.endswith(".json"):
                continue  # random bytes are (almost) never JSON; truncation covers it
            run_dir = runs.copy()
            target = ckpt.step_dir(run_dir, 2) / file
            damage(target, rng)
            cases.append(
                decide(run_dir, ckpt.step_dir(run_dir, 1), str(target), f"{damage.__name__} {file}")
            )
    run_dir = runs.copy()
    a_fifo(ckpt.step_dir(run_dir, 2) / FILES[3], rng)
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), FILES[3], "a FIFO shard"))
    run_dir = runs.copy()
    flip_64_bytes(ckpt.step_dir(run_dir, 2) / FILES[4], rng)
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), FILES[4], "64 bytes flipped"))
    return cases


def pointer_cases(runs: Runs) -> list[Case]:
    cases = []
    for text in ["", "step_00000099\n", "../../etc\n", "garbage\n", "\udcff\udcfe"]:
        run_dir = runs.copy()
        (ckpt.checkpoint_root(run_dir) / ckpt.LATEST).write_text(text, errors="surrogateescape")
        cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), "latest", f"latest {text!r}"))
    run_dir = runs.copy()
    pointer = ckpt.checkpoint_root(run_dir) / ckpt.LATEST
    pointer.unlink()
    pointer.symlink_to(ckpt.LATEST)
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), "latest", "latest a symlink loop"))
    run_dir = runs.copy()
    pointer = ckpt.checkpoint_root(run_dir) / ckpt.LATEST
    pointer.unlink()
    pointer.mkdir()
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), "latest", "latest a directory"))
    run_dir = runs.copy()
    newest = ckpt.step_dir(run_dir, 2)
    shutil.rmtree(newest)
    newest.write_text("not a checkpoint")
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), "latest", "newest a file"))
    return cases


def odd_kind(kind: str, path: Path) -> None:
    """Put `kind` at `path`, where the run expects its own folder or pointer."""
    if kind == "a file":
        path.write_text("someone's notes\n")
    elif kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a dangling symlink":
        path.symlink_to(path.parent / "gone")
    elif kind == "a symlink loop":
        path.symlink_to(path.name)
    elif kind == "a directory":
        path.mkdir()
        (path / "keep.txt").write_text("precious")


KINDS = ["a file", "a FIFO", "a dangling symlink", "a symlink loop"]


def shape_cases(runs: Runs, rng: random.Random) -> list[Case]:
    """The run directory's own shapes (issue 52): checkpoints/corrupt or unfinished taken by
    something that is no directory (a FileExistsError traceback on both ranks), `latest` a
    directory holding a file (deleted with it) or another kind, a manifest listing no files
    (a flipped shard resumed silently). Each is one line and a fallback; nothing is deleted."""
    cases = []
    for kind in KINDS:
        run_dir = runs.copy()
        odd_kind(kind, ckpt.checkpoint_root(run_dir) / "corrupt")
        zero_fill(ckpt.step_dir(run_dir, 2) / FILES[3], rng)
        cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), FILES[3], f"corrupt {kind}"))
        run_dir = runs.copy()
        odd_kind(kind, ckpt.checkpoint_root(run_dir) / "unfinished")
        shutil.copytree(ckpt.step_dir(run_dir, 2), ckpt.step_dir(run_dir, 3))
        (ckpt.step_dir(run_dir, 3) / "manifest.json").unlink()  # a save cut short
        cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, f"unfinished {kind}"))
    for kind in ["a directory", "a FIFO", "a dangling symlink"]:
        run_dir = runs.copy()
        pointer = ckpt.checkpoint_root(run_dir) / ckpt.LATEST
        pointer.unlink()
        odd_kind(kind, pointer)
        cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), "latest", f"latest {kind}"))
    run_dir = runs.copy()
    pointer = ckpt.checkpoint_root(run_dir) / ckpt.LATEST
    pointer.unlink()
    odd_kind("a directory", pointer)
    odd_kind("a file", ckpt.checkpoint_root(run_dir) / "unfinished")
    zero_fill(ckpt.step_dir(run_dir, 2) / FILES[4], rng)
    three = decide(run_dir, ckpt.step_dir(run_dir, 1), FILES[4], "all three at once")
    three.one_line = False  # two problems (the pointer, the shard): a line each
    cases.append(three)
    for flip in (False, True):
        run_dir = runs.copy()
        newest = ckpt.step_dir(run_dir, 2)
        manifest = {"format": 1, "hash": "blake2b-128", "files": {}}
        (newest / "manifest.json").write_text(json.dumps(manifest))
        if flip:
            flip_64_bytes(newest / FILES[3], rng)
        what = "files {}" + (" and 64 bytes flipped" if flip else "")
        cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), "not listed in", what))
    run_dir = runs.copy()
    newest = ckpt.step_dir(run_dir, 2)
    manifest = json.loads((newest / "manifest.json").read_text())
    del manifest["files"][FILES[4]]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 1), FILES[4], "a shard left out"))
    run_dir = runs.copy()
    (ckpt.checkpoint_root(run_dir) / "latest.partial").mkdir()
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, "latest.partial a directory"))
    return cases


def whole_run_cases(runs: Runs, rng: random.Random) -> list[Case]:
    run_dir = runs.copy()
    for step in (1, 2):
        zero_fill(ckpt.step_dir(run_dir, step) / FILES[3], rng)
    cases = [decide(run_dir, None, "no checkpoint", "both shards zero-filled")]
    run_dir = runs.copy()
    truncate(ckpt.step_dir(run_dir, 1) / FILES[0], rng)
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, "the older one broken"))
    run_dir = runs.copy()
    (ckpt.step_dir(run_dir, 2) / "learner" / "notes.txt").write_text("an extra file")
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, "an extra file"))
    run_dir = runs.copy()
    (ckpt.checkpoint_root(run_dir) / "corrupt" / "step_00000009").mkdir(parents=True)
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, "an earlier set-aside"))
    run_dir = runs.copy()
    cases.append(decide(run_dir, ckpt.step_dir(run_dir, 2), None, "untouched"))
    run_dir = runs.copy()
    shutil.rmtree(ckpt.checkpoint_root(run_dir))
    cases.append(decide(run_dir, None, None, "no checkpoints yet"))
    return cases


def test_fuzz_checkpoints(workspace):
    seed = int(os.environ.get("FUZZ_SEED", SEED))
    rng = random.Random(seed)
    pristine = workspace / "pristine"
    made = train(workspace, pristine, steps=2)
    assert made.returncode == 0, made.stderr[-3000:]
    runs = Runs(pristine, workspace / "runs")
    cases = [
        *file_cases(runs, rng),
        *pointer_cases(runs),
        *shape_cases(runs, rng),
        *whole_run_cases(runs, rng),
    ]
    results = [run_case(case, resume_decision) for case in cases]

    # The real command, on a run whose `latest` is a symlink loop and whose newest shard is
    # zero-filled: the loop is named, the damaged checkpoint set aside, nothing deleted.
    resumed = runs.copy()
    shard = ckpt.step_dir(resumed, 2) / FILES[3]
    zero_fill(shard, rng)
    pointer = ckpt.checkpoint_root(resumed) / ckpt.LATEST
    pointer.unlink()
    pointer.symlink_to(ckpt.LATEST)
    done = train(workspace, resumed, steps=3)
    output = done.stdout + done.stderr
    print(f"resumed through the real command: exit {done.returncode}")
    assert done.returncode == 0, output[-3000:]
    assert f"cannot use {pointer}: not a regular file" in output, output[-3000:]
    assert f"cannot be resumed from: {shard}: its bytes differ from the manifest" in output
    assert f"resumed from {ckpt.step_dir(resumed, 1)} (step 1)" in output
    assert "deleted" not in output
    corrupt = ckpt.checkpoint_root(resumed) / "corrupt" / "step_00000002" / FILES[3]
    assert corrupt.read_bytes() == bytes(corrupt.stat().st_size)  # kept as it was found
    steps = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in steps if "reward_mean" in record]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["checkpoints_set_aside"] for r in steps] == [0, 1, 1]  # step 1: the first start
    assert_sound(report("checkpoints", seed, results))
