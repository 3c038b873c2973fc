"""A step's record (orchestrator/step_record.py): built in one place from the learner's
StepMetrics and the rollout side's RolloutStats, each figure computed as written out here,
and the same line in metrics.jsonl as the record gives every sink."""

from __future__ import annotations

import dataclasses
import json

import pytest
from test_length_report import learner_metrics, rollout_stats

from megatron_fr.analysis.run_files import METRICS_FILE
from megatron_fr.buffer.lag_buffer import LengthRecord
from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.orchestrator.step_record import StepRecord


def test_the_record_computes_each_figure_from_its_part() -> None:
    batch = [
        TrajectorySummary("a", 1.0, 13, 10, 4, {}),  # lag at step 6: 6 - 1 - 4 = 1
        TrajectorySummary("b", 0.0, 9, 6, 2, {"turns": 2, "steps": []}),  # lag 3
    ]
    learner = learner_metrics(2)
    rollout = dataclasses.replace(rollout_stats(), occupancy=7, engines={"engines_total": 2.0})
    lengths = LengthRecord(generated=[10, 6, 3], dropped_stale=[3])
    record = StepRecord.build(6, batch, learner, rollout, {"gpu_mem": 1.5}, lengths, 0.5, 2.0, 1)  # type: ignore[arg-type]
    line = record.metrics_line()
    assert line["reward_mean"] == 0.5 and line["lag_mean"] == 2.0 and line["lag_max"] == 3
    assert line["tokens_per_s"] == pytest.approx((13 + 9) / 2.0)
    assert line["response_length_mean"] == 8.0 and line["batch_rollouts"] == 2
    assert line["buffer_occupancy"] == 7 and line["rollouts_total"] == 10
    assert line["retained_tokens_mean"] == learner["retained_tokens_mean"]
    assert line["checkpoints_set_aside"] == 1 and line["sync_s"] == 0.5
    assert line["engines_total"] == 2.0 and line["gpu_mem"] == 1.5
    assert line["turns_mean"] == 2.0  # the episode figures of the one text-task trajectory
    assert "extra" not in line and "batch" not in line
    assert record.batch_line()["retained_tokens"] == learner["retained_tokens"]
    assert record.batch_line()["generated_lengths"] == [10, 6, 3]


def test_metrics_jsonl_holds_the_records_line(tmp_path) -> None:
    from test_length_report import write_run

    write_run(tmp_path)
    steps = [json.loads(line) for line in (tmp_path / METRICS_FILE).open()]
    first = next(line for line in steps if line.get("step") == 1 and "reward_mean" in line)
    fields = {f.name for f in dataclasses.fields(StepRecord)} - {"extra", "batch"}
    assert fields <= set(first)
    assert first["reward_mean"] == 0.5 and first["retained_tokens_mean"] == 4.0
