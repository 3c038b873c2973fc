"""The training loop end to end, as a user runs it: `megatron-fr train` starts 2 megatron
learner ranks (EP2, gloo) under torchrun, a CPU engine, the rollout workers and the gloo
weight broadcast; short runs of the CPU demo recipe."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
QUICK = [
    "eval.problems=40", "eval.samples=2", "eval.every_steps=0", "buffer.batch_size=16",
    "buffer.capacity=64", "buffer.max_in_flight=32",
]  # fmt: skip
REQUIRED = ("step", "policy_version", "reward_mean", "acceptance_rate", "lag_mean", "lag_max",
            "tokens_per_s", "rollouts_total")  # fmt: skip


def train_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "megatron_fr", "train", str(RECIPE), "--run-dir", str(run_dir),
            *QUICK, *overrides]  # fmt: skip


def run_env() -> dict:
    return os.environ | {"PYTHONPATH": str(REPO)}


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One short run with a quick warm start (its model is reused by the other tests)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    command = train_command(
        run_dir, "steps=5", "checkpoint.every_steps=5",
        "model.warm_start={steps: 60, batch_size: 32}",
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=run_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


@pytest.mark.distributed
def test_demo_runs_through_the_real_chain_and_keeps_lag_bounded(demo_run):
    steps = [r for r in records(demo_run) if "reward_mean" in r]
    evals = [r for r in records(demo_run) if "eval_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4, 5]
    for row in steps:
        assert all(key in row for key in REQUIRED), row
        assert 0 <= row["lag_mean"] <= row["lag_max"] <= 2, row  # max_lag of the recipe
        assert 0 <= row["acceptance_rate"] <= 1 and 0 <= row["reward_mean"] <= 1
    assert max(r["lag_max"] for r in steps) >= 1, "rollouts should run ahead of the learner"
    assert [r["step"] for r in evals] == [0, 5] and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    assert (demo_run / "config.yaml").exists() and any((demo_run / "tensorboard").iterdir())
    assert (demo_run / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    plot = subprocess.run(
        [sys.executable, "-m", "megatron_fr", "plot", str(demo_run)],
        capture_output=True, text=True, env=run_env(), timeout=120,
    )  # fmt: skip
    assert plot.returncode == 0 and (demo_run / "metrics.png").stat().st_size > 10_000


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.distributed
def test_sigkill_mid_run_then_the_same_command_resumes(demo_run, tmp_path):
    run_dir = tmp_path / "run"
    command = train_command(
        run_dir, "steps=30", "checkpoint.every_steps=2", f"model.hf_dir={demo_run / 'warm_start'}"
    )
    process = subprocess.Popen(
        command, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        latest = run_dir / "checkpoints" / "latest"
        _wait_for(lambda: latest.exists() and latest.read_text().strip() >= "step_00000004",
                  600, "the step-4 checkpoint")  # fmt: skip
        _wait_for(lambda: max((r["step"] for r in records(run_dir)), default=0) >= 5, 300,
                  "step 5")  # fmt: skip
    finally:
        os.kill(process.pid, signal.SIGKILL)  # the run's top process, as a scheduler would
        process.wait()
    time.sleep(3)  # ranks and the engine notice their parent is gone within a second
    killed_at = max(r["step"] for r in records(run_dir))
    time.sleep(3)
    assert max(r["step"] for r in records(run_dir)) == killed_at, "ranks outlived the kill"
    assert killed_at < 30
    result = subprocess.run(command, capture_output=True, text=True, env=run_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", result.stdout)
    assert resumed, result.stdout[-2000:]
    assert 4 <= int(resumed.group(1)) <= killed_at
    steps = [r["step"] for r in records(run_dir) if "reward_mean" in r]
    assert steps == list(range(1, 31)), f"killed after step {killed_at}; steps logged {steps}"
    trained = [p for r in records(run_dir, "batches.jsonl") for p in r["prompt_ids"]]
    assert [r["step"] for r in records(run_dir, "batches.jsonl")] == list(range(1, 31))
    problems = [prompt_id.split("@")[0] for prompt_id in trained]
    assert len(problems) == len(set(problems)), "a problem was trained twice within an epoch"


@pytest.mark.distributed
def test_grpo_runs_from_the_same_recipe(demo_run, tmp_path):
    run_dir = tmp_path / "grpo"
    command = train_command(
        run_dir, "steps=2", "learner.estimator=grpo", "buffer.group_size=4",
        f"model.hf_dir={demo_run / 'warm_start'}",
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=run_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    batches = records(run_dir, "batches.jsonl")
    assert [r["step"] for r in batches] == [1, 2]
    groups = {}
    for prompt_id in batches[0]["prompt_ids"]:
        groups.setdefault(prompt_id.split("#")[0], []).append(prompt_id)
    assert max(len(members) for members in groups.values()) == 4  # G rollouts of one problem


@pytest.mark.distributed
def test_stop_file_checkpoints_and_ends_the_run_then_it_resumes(demo_run, tmp_path):
    """The preemption path a Slurm USR1 trap takes: RUN_DIR/STOP ends the run after the current
    step with that step's checkpoint (exit 0); the same command resumes from it."""
    run_dir = tmp_path / "run"
    command = train_command(
        run_dir, "steps=8", "checkpoint.every_steps=100", f"model.hf_dir={demo_run / 'warm_start'}"
    )
    process = subprocess.Popen(command, env=run_env(), stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        _wait_for(lambda: (run_dir / "metrics.jsonl").exists()
                  and max((r.get("step", 0) for r in records(run_dir)), default=0) >= 2,
                  600, "step 2")  # fmt: skip
        (run_dir / "STOP").touch()
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-2000:]
    stopped = re.search(r"stopped on request at step (\d+)", output)
    assert stopped, output[-2000:]
    stopped_at = int(stopped.group(1))
    assert 2 <= stopped_at < 8 and not (run_dir / "STOP").exists()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:08d}"
    result = subprocess.run(command, capture_output=True, text=True, env=run_env(), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"(step {stopped_at})" in result.stdout
    assert [r["step"] for r in records(run_dir) if "reward_mean" in r] == list(range(1, 9))
