"""`megatron-fr train` through real SGLang 0.5.23 on CPU: the CPU demo recipe with
rollout.engine.kind=sglang (the pool's launcher starts SGLang from .venv-sglang with its CPU
flags), 6 steps at max_lag 2, a weight sync into SGLang after every step over its session
protocol (begin / update_weights_from_distributed / end, gloo) and the sync check after each;
after step 2 the SGLang server is SIGKILLed, and the pool restarts it, forms a weight-update
group with the new process, pushes the current weights and re-admits it once /model_info
says it serves them.

What must hold, read from the run's own files:
- every step was taken, and a later step trained rollouts at least one version old (lag >= 1:
  rollouts generated across a sync, so the engine served weights the learner pushed);
- every sync check scored SGLang's log-probs of the probe against the learner's at the version
  just pushed, and none failed: sync_logprob_gap is in metrics.jsonl at every step whose sync
  had a server (the steps trained from held rollouts while the server was out have none),
  the last step's among them (the restarted server), within GAP_BOUND (a push that loaded
  the wrong bytes, or that SGLang refused, would show here; so would a restarted server that
  rejoined with its checkpoint's weights). SGLang's CPU kernels are not the learner's: the
  largest per-token gap on the 16-token probe measured 6.4e-4, 1.3e-2 and 4.0e-3 at steps
  1-3 of one run, 3.1e-4 to 9.3e-4 in another;
- faults.jsonl: the engine out (it exited), then joining and in again: one restart.
The demo model's MoE layers run on SGLang's torch-native CPU path; its routed experts cannot
be returned on CPU (SGLang pins host memory with CUDA for them), so routing replay is not run
here."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from training_runs import Run, last_step, records, run_processes, step_rows, train_args

from megatron_fr.engine.sglang.launch import SHIM_MODULE

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
STEPS = 6
KILL_AFTER_STEP = 2
"""Killed after step 2: the learner trains on from the rollouts it holds (max_lag 2) while the
server restarts, and the last steps sync into, and check, the restarted server."""
SERVER = SHIM_MODULE
"""The SGLang server's module on CPU (`python -m SERVER`, its launch_server behind the shims):
the server's main process, the one the test kills."""
GAP_BOUND = 0.05
"""Nats: four times the largest gap measured (module docstring), far below the recipe's own
weights.verify_tolerance (1.0)."""


def test_train_through_real_sglang_with_every_sync_checked_and_the_engine_killed(
    sglang_python, demo_model, tmp_path
):
    run_dir = tmp_path / "run"
    settings = [
        f"model.hf_dir={demo_model}",
        f"steps={STEPS}",
        "rollout.engine.kind=sglang",
        f"rollout.engine.python={sglang_python}",
        "rollout.engine.start_timeout_s=900",
        "weights.verify_every=1",
        "weights.spot_check=0",  # SGLang reads back no qwen3_moe weights: the check refuses it
        "eval.every_steps=0",
        "eval.problems=8",
        "checkpoint.every_steps=100",
        "rollout.engine.restarts=1",
        "rollout.engine.restart_backoff_s=0.5",
    ]
    with Run(train_args(RECIPE, run_dir, *settings), tmp_path) as run:
        run.wait_for(lambda: last_step(run_dir) >= KILL_AFTER_STEP, 1200, "step 2")
        server = next(p for p in run_processes(run.marker) if SERVER in " ".join(p.cmdline()))
        os.kill(server.pid, signal.SIGKILL)
        assert run.wait(1500) == 0, run.output()[-4000:]
    steps = step_rows(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert any(m["lag_max"] >= 1 for m in steps), [m["lag_max"] for m in steps]
    served = [m for m in steps if m["engines_serving"] >= 1]  # a step whose sync had a server
    assert served[-1]["step"] == STEPS and served[-1]["engines_restarted_total"] == 1, served
    gaps = [m.get("sync_logprob_gap") for m in served]
    assert all(gap is not None and gap < GAP_BOUND for gap in gaps), gaps
    assert all(m["sync_checks_failed"] == 0 for m in served)
    events = [(f["event"], f["cause"]) for f in records(run_dir, "faults.jsonl")]
    assert [e for e, _ in events] == ["out", "joining", "in"], events
    assert events[0][1].startswith("exited with code -9"), events
    assert steps[-1]["engines_restarted_total"] == 1, steps[-1]
