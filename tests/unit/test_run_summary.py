"""The block `megatron-fr train` ends with (orchestrator/summary.py), read from hand-written
metrics.jsonl files whose figures are worked out here by hand."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_fr.orchestrator.summary import run_summary


def write_metrics(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(record) + "\n" for record in records)
    (run_dir / "metrics.jsonl").write_text(lines, encoding="utf-8")
    return run_dir


def step(n: int, generated: int, batch: int, dropped: int, seconds: float, **more) -> dict:
    record = dict(
        step=n,
        policy_version=n,
        reward_mean=0.5,
        rollouts_total=generated,
        batch_rollouts=batch,
        dropped_total=dropped,
        discarded_total=0,
        abandoned_total=0,
        step_s=seconds,
    )
    return record | more


def evaluation(n: int, accuracy: float | None, std: float | None = None, **sets) -> dict:
    record = dict(step=n, rollouts_total=0, eval_incomplete=int(accuracy is None))
    record["eval_accuracy"] = accuracy
    if std is not None:
        record["eval_accuracy_std"] = std
    return record | sets


RUN = [
    evaluation(0, 0.4, 0.02),
    step(1, 80, 64, 0, 3.0),
    step(2, 150, 64, 5, 5.0),
    evaluation(2, None),  # incomplete: skipped, never read as 0
    step(3, 230, 60, 7, 4.0, discarded_total=2),
    evaluation(3, 0.55, 0.01),
]


def test_the_block_says_how_the_run_went_and_what_to_run_next(tmp_path) -> None:
    run_dir = write_metrics(tmp_path / "run", RUN)
    assert run_summary(run_dir, steps=3).splitlines() == [
        "-- run summary " + "-" * 50,
        "steps trained      3 of 3",
        # generated: the last rollouts_total; trained: 64 + 64 + 60; dropped: the last total
        "rollouts           230 generated, 188 trained, 7 dropped as stale, 2 discarded",
        "held-out accuracy  0.400 ± 0.020 (step 0) -> 0.550 ± 0.010 (step 3)",
        "time per step      4.0 s (mean of 3)",  # (3 + 5 + 4) / 3
        f"run directory      {run_dir}",
        f"next               megatron-fr plot {run_dir}",
        f"                   megatron-fr lengths {run_dir}",
        f"                   tensorboard --logdir {run_dir}/tensorboard",
    ]


def test_each_eval_set_gets_a_row_and_missing_figures_are_not_made_up(tmp_path) -> None:
    sets0 = dict(eval_a_accuracy=0.2, eval_a_accuracy_std=0.1, eval_b_accuracy=0.6)
    sets1 = dict(eval_a_accuracy=0.3, eval_a_accuracy_std=0.1, eval_b_accuracy=0.8)
    old_step = step(1, 70, 64, 1, 2.0)
    del old_step["batch_rollouts"]  # a line written before the count existed
    records = [evaluation(0, 0.4, **sets0), old_step, evaluation(1, 0.55, **sets1)]
    text = run_summary(write_metrics(tmp_path / "run", records), tensorboard=False)
    assert "steps trained      1\n" in text
    assert "rollouts           70 generated, 1 dropped as stale\n" in text
    assert "held-out accuracy  0.400 (step 0) -> 0.550 (step 1)\n" in text
    assert "  a                0.200 ± 0.100 (step 0) -> 0.300 ± 0.100 (step 1)\n" in text
    assert "  b                0.600 (step 0) -> 0.800 (step 1)\n" in text
    assert "tensorboard" not in text


def test_a_run_without_steps_or_evaluations_still_gets_its_block(tmp_path) -> None:
    text = run_summary(write_metrics(tmp_path / "run", []), steps=5)
    assert "steps trained      0 of 5" in text
    assert "held-out accuracy  no evaluation with an accuracy" in text
    assert "rollouts" not in text and "time per step" not in text
