"""A single engine that dies, or stops answering, while the learner waits on it, through the
real run (`megatron-fr train` of the CPU demo, 2 gloo learner ranks, one CPU engine):

- SIGKILLed during the step-0 evaluation, with a restart allowed: the pool restarts it, the
  learner (waiting on the evaluation, not on a step) syncs the current weights into it as soon
  as it joins, and the run finishes every step with that evaluation complete (no step is
  needed between the death and the re-admission, which is what a single-engine run lacked).
- SIGSTOPped while the learner waits for a batch, then a STOP file: the run ends within 30 s,
  on request (exit 0), with a checkpoint of the step it reached, which a start resumes from.
  (A STOP that comes while a weight sync waits on a hung engine waits for the sync's own
  bound first: the engine is out after rollout.engine.unreachable_after_s, 30 s.)
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
def test_a_lone_engine_killed_in_an_evaluation_or_stopped_in_a_wait_never_stalls_the_run(
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
        (run_dir / "STOP").touch()
        asked = time.monotonic()
        code = run.wait(120)
        took = time.monotonic() - asked
    finally:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.wait(60)
    output = run.output()
    assert code == 0, output[-4000:]
    assert took < 30.0, (took, output[-4000:])
    assert "stopped on request at step" in output, output[-4000:]
    step = int(output.split("stopped on request at step ")[1].split()[0])
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "manifest.json").exists()
    assert latest == f"step_{step:08d}", (latest, step)
    wait_until(lambda: not run_processes(marker), 30, "no process left")
