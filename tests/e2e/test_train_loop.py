"""The training loop end to end, as a user runs it: `megatron-fr train` starts 2 megatron
learner ranks (EP2, gloo) under torchrun, a CPU engine, the rollout service and the gloo
weight broadcast; short runs of the CPU demo recipe. Kills, STOP files and resumes are in
tests/faults; GRPO with whole groups under injected failures in test_grpo_loop.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from training_runs import records, run_megatron_fr, step_rows, train_args

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
QUICK = [
    "eval.problems=8",
    "eval.samples=2",
    "eval.every_steps=0",
    "buffer.batch_size=16",
    "buffer.capacity=64",
    "buffer.max_in_flight=32",
]
REQUIRED = (
    "step",
    "policy_version",
    "reward_mean",
    "acceptance_rate",
    "lag_mean",
    "lag_max",
    "tokens_per_s",
    "rollouts_total",
)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, demo_model):
    """One short run from the quickly warm-started demo model."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    settings = ["steps=5", "checkpoint.every_steps=5", f"model.hf_dir={demo_model}"]
    run_megatron_fr(*train_args(RECIPE, run_dir, *QUICK, *settings))
    return run_dir


@pytest.mark.distributed
def test_demo_runs_through_the_real_chain_and_keeps_lag_bounded(demo_run):
    steps = step_rows(demo_run)
    evals = [r for r in records(demo_run) if "eval_accuracy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4, 5]
    for row in steps:
        assert all(key in row for key in REQUIRED), row
        assert 0 <= row["lag_mean"] <= row["lag_max"] <= 2, row  # max_lag of the recipe
        assert 0 <= row["acceptance_rate"] <= 1 and 0 <= row["reward_mean"] <= 1
    assert max(r["lag_max"] for r in steps) >= 1, "rollouts should run ahead of the learner"
    # batches.jsonl: each trajectory's gate decision and KL, consistent with the step's means
    for row, batch in zip(steps, records(demo_run, "batches.jsonl"), strict=True):
        assert len(batch["admitted"]) == len(batch["sequence_kl"]) == 16  # buffer.batch_size
        assert sum(batch["admitted"]) / 16 == pytest.approx(row["acceptance_rate"])
        kl = sum(batch["sequence_kl"]) / 16
        assert kl == pytest.approx(row["sequence_kl_mean"], rel=1e-6, abs=1e-12)
    assert [r["step"] for r in evals] == [0, 5] and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    assert (demo_run / "config.yaml").exists() and any((demo_run / "tensorboard").iterdir())
    assert (demo_run / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    run_megatron_fr("plot", str(demo_run), timeout_s=120)
    assert (demo_run / "metrics.png").stat().st_size > 10_000
