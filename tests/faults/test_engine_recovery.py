"""An engine that dies, or stops answering, while the learner waits on it, through the real
run (`megatron-fr train` of the CPU demo, 2 gloo learner ranks, one CPU engine unless said):

- SIGKILLed during the step-0 evaluation, with a restart allowed: the pool restarts it, the
  learner (waiting on the evaluation, not on a step) syncs the current weights into it as soon
  as it joins, and the run finishes every step with that evaluation complete (no step is
  needed between the death and the re-admission, which is what a single-engine run lacked).
- SIGSTOPped while the learner waits for a batch, then a STOP file: the run ends within 30 s,
  on request (exit 0), with a checkpoint of the step it reached, which a start resumes from.
- One of two engines SIGSTOPped, so that the learner's next weight sync waits on it (the other
  engine keeps the batches coming), then a STOP file: the sync is given up, the step it
  belonged to is logged and saved, and the run ends within 30 s (exit 0), not at the sync's
  own bound (weights.timeout_s, 120 s).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from test_fault_injection import (
    Run,
    prompt_files,
    records,
    run_processes,
    served_version,
    wait_until,
)


def engine_of(marker: str) -> tuple[int, str]:
    """The run's CPU engine: its pid and URL, once it has started."""
    engine = next(p for p in run_processes(marker) if "engine.cpu.server" in " ".join(p.cmdline()))
    command = engine.cmdline()
    return engine.pid, f"http://127.0.0.1:{command[command.index('--port') + 1]}"


def has_engine(marker: str) -> bool:
    return any("engine.cpu.server" in " ".join(p.cmdline()) for p in run_processes(marker))


@pytest.mark.distributed
@pytest.mark.faults
def test_an_engine_killed_or_stopped_while_the_learner_waits_never_stalls_the_run(
    tmp_path, demo_model
):
    data = prompt_files(tmp_path / "data")
    base = [f"model.hf_dir={demo_model}", *data, "rollout.engine.restarts=1"]

    # 1. Killed during the step-0 evaluation: restarted, re-admitted at once, all steps done.
    run_dir, marker = tmp_path / "killed", uuid.uuid4().hex
    run_dir.mkdir()
    settings = [*base, "steps=2", "eval.problems=48", "eval.samples=2"]
    run = Run(run_dir, marker, settings)
    try:
        wait_until(lambda: has_engine(marker) or run.process.poll() is not None, 300, "engine")
        pid, url = engine_of(marker)
        wait_until(lambda: served_version(url) == "0", 300, "the learner's weights served")
        time.sleep(2.0)  # the step-0 evaluation is under way
        assert not records(run_dir, "metrics.jsonl"), "the evaluation ended before the kill"
        os.kill(pid, signal.SIGKILL)
        assert run.wait(600) == 0, run.output()[-4000:]
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.wait(60)
    metrics = records(run_dir, "metrics.jsonl")
    evaluations = [r for r in metrics if "eval_accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 2], evaluations
    assert evaluations[0]["eval_incomplete"] == 0 and evaluations[0]["eval_accuracy"] is not None
    assert [r["step"] for r in metrics if "reward_mean" in r] == [1, 2]
    events = [f["event"] for f in records(run_dir, "faults.jsonl")]
    assert events[:3] == ["out", "joining", "in"], events

    # 2. Stopped (SIGSTOP) while the learner waits for a batch, then a STOP file. At max_lag 0
    # no rollout of the next batch starts before the step's sync, so once a step is logged
    # the learner's next wait is for a batch the stopped engine never finishes.
    run_dir, marker = tmp_path / "stopped", uuid.uuid4().hex
    run_dir.mkdir()
    settings = [*base, "steps=20", "buffer.max_lag=0", "eval.every_steps=0", "eval.problems=8"]
    run = Run(run_dir, marker, settings)
    try:
        wait_until(
            lambda: (
                any("reward_mean" in r for r in records(run_dir, "metrics.jsonl"))
                or run.process.poll() is not None
            ),
            600,
            "step 1",
        )
        assert run.process.poll() is None, run.output()[-4000:]
        pid, _ = engine_of(marker)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3.0)  # every request in flight hangs; the learner waits
        code, took = stop(run, run_dir)
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.wait(60)
    assert_stopped_at_a_checkpoint(run, run_dir, code, took)
    wait_until(lambda: not run_processes(marker), 30, "no process left")

    # 3. One of two engines stopped: the learner's next sync waits on it; then a STOP file.
    run_dir, marker = tmp_path / "stopped-in-a-sync", uuid.uuid4().hex
    run_dir.mkdir()
    settings = [*base, "steps=40", "rollout.engine.count=2", "eval.every_steps=0"]
    run = Run(run_dir, marker, [*settings, "eval.problems=8"])
    try:
        wait_until(lambda: last_step(run_dir) >= 2 or run.process.poll() is not None, 600, "step 2")
        assert run.process.poll() is None, run.output()[-4000:]
        pid, _ = engine_of(marker)
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: holds(run_dir, 3.0), 60, "the learner waiting in a sync")
        code, took = stop(run, run_dir)
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.wait(60)
    step = assert_stopped_at_a_checkpoint(run, run_dir, code, took)
    logged = [r["step"] for r in records(run_dir, "metrics.jsonl") if "reward_mean" in r]
    assert logged == list(range(1, step + 1)), logged  # the interrupted step is logged too
    wait_until(lambda: not run_processes(marker), 30, "no process left")


def last_step(run_dir) -> int:
    return max(
        (r["step"] for r in records(run_dir, "metrics.jsonl") if "reward_mean" in r), default=0
    )


def holds(run_dir, seconds: float) -> bool:
    """The step counter did not move for `seconds`: the learner waits (here, in a sync)."""
    before = last_step(run_dir)
    time.sleep(seconds)
    return last_step(run_dir) == before


def stop(run: Run, run_dir) -> tuple[int | None, float]:
    """A STOP file; the run's exit code (None: still running after 120 s) and the seconds
    from the request to its end."""
    (run_dir / "STOP").touch()
    asked = time.monotonic()
    code = run.wait(120)
    return code, time.monotonic() - asked


def assert_stopped_at_a_checkpoint(run: Run, run_dir, code: int | None, took: float) -> int:
    """The run stopped on request within 30 s (exit 0) at a step whose checkpoint is the
    latest; returns that step."""
    output = run.output()
    assert code == 0, output[-4000:]
    assert took < 30.0, (took, output[-4000:])
    assert "stopped on request at step" in output, output[-4000:]
    step = int(output.split("stopped on request at step ")[1].split()[0])
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "manifest.json").exists()
    assert latest == f"step_{step:08d}", (latest, step)
    return step
