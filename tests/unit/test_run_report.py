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


def test_an_incomplete_evaluation_is_logged_without_accuracy_drawn_as_a_marker_and_skipped(
    tmp_path, capsys
):
    """An evaluation the pool could not serve: a line with eval_accuracy null, the reason and
    the failed episodes counted, printed; the plot marks it at its step instead of a point at
    0, and the results code (compare's summary, the plot's title) reads only the honest one."""
    from matplotlib.figure import Figure

    from megatron_fr.analysis import plot
    from megatron_fr.analysis.compare_report import summarise
    from megatron_fr.rollout.service import Evaluation

    config = load_run_config(RECIPE)
    run_dir = tmp_path / "run"
    report = RunReport(config, run_dir, step=0)
    report.evaluation(0, Evaluation({"heldout": (0.4, 0.1)}, failed_episodes=2), 0)
    report.evaluation(5, Evaluation({}, failed_episodes=200, incomplete="no engine served"), 320)
    report.close()
    assert "step 5: evaluation incomplete: no engine served" in capsys.readouterr().out
    honest, incomplete = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert (honest["eval_accuracy"], honest["eval_failed_episodes"]) == (0.4, 2)
    assert honest["eval_incomplete"] == 0
    assert incomplete["eval_accuracy"] is None and "eval_heldout_accuracy" not in incomplete
    assert (incomplete["eval_incomplete"], incomplete["eval_failed_episodes"]) == (1, 200)
    assert incomplete["eval_incomplete_reason"] == "no engine served"

    records = [honest, incomplete]
    ax = Figure().subplots()
    plot._draw_panel(ax, records, "step", ("eval_heldout_accuracy",))
    marker, curve = ax.lines
    assert list(curve.get_xdata()) == [0] and list(curve.get_ydata()) == [0.4]
    assert list(marker.get_xdata()) == [5, 5] and marker.get_label() == "incomplete eval"
    assert plot._title(run_dir, records).endswith("eval accuracy 0.400 at step 0")
    assert summarise("v", 0, run_dir, batch_size=64).curve == [(0, 0.4)]
