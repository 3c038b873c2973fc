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
    engine_process,
    has_engine,
    port_of,
    prompt_files,
    served_version,
    start,
)
from training_runs import Run, last_step, records, step_rows, wait_until


def engine_of(marker: str) -> tuple[int, str]:
    """The run's CPU engine: its pid and URL, once it has started."""
    engine = engine_process(marker)
    return engine.pid, f"http://127.0.0.1:{port_of(engine)}"


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
    with start(run_dir, marker, settings) as run:
        run.wait_for(lambda: has_engine(marker), 300, "engine")
        pid, url = engine_of(marker)
        wait_until(lambda: served_version(url) == "0", 300, "the learner's weights served")
        time.sleep(2.0)  # the step-0 evaluation is under way
        assert not records(run_dir, running=True), "the evaluation ended before the kill"
        os.kill(pid, signal.SIGKILL)
        assert run.wait(600) == 0, run.output()[-4000:]
    metrics = records(run_dir, "metrics.jsonl")
    evaluations = [r for r in metrics if "eval_accuracy" in r]
    assert [r["step"] for r in evaluations] == [0, 2], evaluations
    assert evaluations[0]["eval_incomplete"] == 0 and evaluations[0]["eval_accuracy"] is not None
    assert [r["step"] for r in step_rows(run_dir)] == [1, 2]
    events = [f["event"] for f in records(run_dir, "faults.jsonl")]
    assert events[:3] == ["out", "joining", "in"], events

    # 2. Stopped (SIGSTOP) while the learner waits for a batch, then a STOP file. At max_lag 0
    # no rollout of the next batch starts before the step's sync, so once a step is logged
    # the learner's next wait is for a batch the stopped engine never finishes.
    run_dir, marker = tmp_path / "stopped", uuid.uuid4().hex
    run_dir.mkdir()
    settings = [*base, "steps=20", "buffer.max_lag=0", "eval.every_steps=0", "eval.problems=8"]
    with start(run_dir, marker, settings) as run:
        run.wait_for(lambda: last_step(run_dir) >= 1, 600, "step 1")
        pid, _ = engine_of(marker)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3.0)  # every request in flight hangs; the learner waits
        code, took = run.stop(run_dir, 120)
    assert_stopped_at_a_checkpoint(run, run_dir, code, took)
    run.wait_gone()

    # 3. One of two engines stopped: the learner's next sync waits on it; then a STOP file.
    run_dir, marker = tmp_path / "stopped-in-a-sync", uuid.uuid4().hex
    run_dir.mkdir()
    settings = [*base, "steps=40", "rollout.engine.count=2", "eval.every_steps=0"]
    with start(run_dir, marker, [*settings, "eval.problems=8"]) as run:
        run.wait_for(lambda: last_step(run_dir) >= 2, 600, "step 2")
        pid, _ = engine_of(marker)
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: holds(run_dir, 3.0), 60, "the learner waiting in a sync")
        code, took = run.stop(run_dir, 120)
    step = assert_stopped_at_a_checkpoint(run, run_dir, code, took)
    logged = [r["step"] for r in step_rows(run_dir)]
    assert logged == list(range(1, step + 1)), logged  # the interrupted step is logged too
    run.wait_gone()


def holds(run_dir, seconds: float) -> bool:
    """The step counter did not move for `seconds`: the learner waits (here, in a sync)."""
    before = last_step(run_dir)
    time.sleep(seconds)
    return last_step(run_dir) == before


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
