"""The length record of a run: RunReport.step writes per step the response lengths generated and
dropped as stale and the tokens masked, and `megatron-fr lengths` reads them back into the
table (drop rate, mean / median lengths, masked share, reward, accuracy) and a PNG. The
expected figures are computed by hand from the two steps written out below."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megatron_fr import cli
from megatron_fr.analysis import length_report
from megatron_fr.analysis.run_files import BATCHES_FILE
from megatron_fr.buffer.lag_buffer import LengthRecord
from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator.report import RunReport
from megatron_fr.rollout.service import Evaluation
from megatron_fr.rollout.stats import RolloutStats

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


def learner_metrics(batch: int) -> dict:
    return dict(
        loss=0.0,
        acceptance_rate=1.0,
        clip_fraction=0.0,
        sequence_kl_mean=0.0,
        admitted=[True] * batch,
        sequence_kl=[0.0] * batch,
        retained_tokens_mean=4.0,
        retained_tokens=[4.0] * batch,
        adam_step_min=0.0,
        adam_step_max=0.0,
        grad_norm=1.0,
        update_successful=1.0,
        lr=1e-4,
        policy_tokens=1.0,
        nonfinite=None,
        advantages=[0.0] * batch,
        padding_fraction=0.0,
        dp_imbalance=0.0,
        step_skipped=0.0,
        skipped_steps_total=0,
    )


def rollout_stats() -> RolloutStats:
    return RolloutStats(
        rollouts_total=10,
        rollout_failures_total=0,
        rollout_failures={},
        occupancy=0,
        dropped_total=0,
        stale_tokens_masked_total=0,
        discarded_total=0,
        abandoned_total=0,
        groups_failed_total=0,
        engines={},
    )


def summary(prompt_id: str, response: int, reward: float, masked: int = 0) -> TrajectorySummary:
    info = {"stale_tokens_masked": masked} if masked else {}
    return TrajectorySummary(prompt_id, reward, response + 3, response, 0, info)


def write_run(run_dir: Path) -> None:
    """Step 1: generated 10, 4, 6 (the 10 dropped), trained 4 and 6 (2 of its tokens masked:
    8 as generated). Step 2: generated 2, 20 (both dropped), trained the 2 (reward 1)."""
    report = RunReport(load_run_config(RECIPE), run_dir, step=0)
    steps = [
        (
            [summary("a", 4, 0.0), summary("b", 6, 1.0, masked=2)],
            LengthRecord(generated=[10, 4, 6], dropped_stale=[10]),
        ),
        ([summary("c", 2, 1.0)], LengthRecord(generated=[2, 20], dropped_stale=[20])),
    ]
    for step, (batch, lengths) in enumerate(steps, start=1):
        metrics = learner_metrics(len(batch))
        report.step(step, batch, metrics, {}, 0.1, rollout_stats(), lengths, 1.0)  # type: ignore[arg-type]
    report.evaluation(2, Evaluation({"heldout": (0.25, 0.0)}, failed_episodes=0), 12)
    report.close()


def test_batches_jsonl_records_the_lengths_and_the_masked_tokens(tmp_path):
    write_run(tmp_path)
    first, second = [json.loads(line) for line in (tmp_path / BATCHES_FILE).open()]
    assert first["generated_lengths"] == [10, 4, 6]
    assert first["dropped_stale_lengths"] == [10]
    assert first["response_lengths"] == [4, 6]
    assert first["stale_tokens_masked"] == [0, 2]
    assert second["dropped_stale_lengths"] == [20]


def test_the_report_counts_generated_dropped_and_trained_at_their_generated_length(tmp_path):
    write_run(tmp_path)
    lengths = length_report.run_lengths(
        length_report.read_run_log(tmp_path, BATCHES_FILE),
        length_report.read_metrics(tmp_path),
    )
    assert lengths.generated == [10, 4, 6, 2, 20]
    assert lengths.dropped == [10, 20]
    assert lengths.trained == [4, 8, 2]  # 6 trained + 2 masked
    assert lengths.drop_rate == pytest.approx(2 / 5)
    assert lengths.masked_share == pytest.approx(2 / 14)
    assert lengths.untrained_share == pytest.approx((10 + 20 + 2) / 42)
    assert lengths.reward_mean == pytest.approx(2 / 3)
    assert lengths.accuracy == 0.25
    command = ["lengths", str(tmp_path), "--names", "masked", "--out", str(tmp_path / "l.png")]
    assert cli.main(command) == 0
    assert (tmp_path / "l.png").stat().st_size > 0
    row = length_report.table([("masked", lengths)]).splitlines()[-1]
    # generated mean 42 / 5 = 8.4, median 6; dropped 15 / 15; trained 14 / 3 = 4.7, median 4;
    # not trained 32 / 42 = 76.2 %
    assert row == (
        "| masked | 5 | 2 | 40.0% | 8.4 / 6 | 15.0 / 15 | 4.7 / 4 | 14.3% | 76.2% | 0.667 | 0.250 |"
    )
    from_two = length_report.run_lengths(length_report.read_run_log(tmp_path, BATCHES_FILE), (), 2)
    assert (from_two.generated, from_two.trained, from_two.accuracy) == ([2, 20], [2], None)


def test_a_run_without_the_length_fields_is_refused(tmp_path, capsys):
    (tmp_path / BATCHES_FILE).write_text(json.dumps({"step": 1, "rewards": [1.0]}) + "\n")
    (tmp_path / "metrics.jsonl").write_text("")
    args = argparse.Namespace(run_dirs=[str(tmp_path)], from_step=1, names=None, out=None)
    assert length_report.main(args) == 2
    assert "predates their logging" in capsys.readouterr().err
