"""RunReport on a run directory that already holds logs: each step and each evaluation is
logged once, whether the run resumes from a checkpoint or starts again from step 0."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator.report import RunReport

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
EARLIER = [
    {"step": 0, "rollouts_total": 0, "eval_accuracy": 0.5},
    {"step": 1, "reward_mean": 0.5},
    {"step": 2, "reward_mean": 0.6},
]


def write_logs(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in EARLIER))
    (run_dir / "batches.jsonl").write_text(
        "".join(json.dumps({"step": r["step"]}) + "\n" for r in EARLIER[1:])
    )


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_resume_keeps_what_the_checkpoint_covers_and_a_fresh_start_keeps_nothing(tmp_path):
    config = load_run_config(RECIPE)
    resumed = tmp_path / "resumed"
    write_logs(resumed)
    RunReport(config, resumed, step=1).close()
    assert steps(resumed / "metrics.jsonl") == [0, 1]  # step 0's evaluation is not redone
    assert steps(resumed / "batches.jsonl") == [1]

    restarted = tmp_path / "restarted"  # killed before its first checkpoint
    write_logs(restarted)
    RunReport(config, restarted, step=0).close()
    assert steps(restarted / "metrics.jsonl") == []  # step 0 is evaluated again
    assert steps(restarted / "batches.jsonl") == []
