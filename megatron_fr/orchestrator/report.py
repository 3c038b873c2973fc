"""What the first learner rank records of a run: per-step and eval metrics, and each batch.

    run_dir/metrics.jsonl   a line per optimizer step and per evaluation (run_log.RunLogger,
                            with the progress bar, TensorBoard and W&B: sinks.py)
    run_dir/batches.jsonl   a line per step: the prompt ids, response lengths, rewards, the
                            advantages the learner used, and per trajectory the gate's KL
                            D_i, whether it was admitted and its tokens that carried gradient
                            (which trajectories a gate holds out, and of which sign, is what
                            explains a gated run's course);
                            the policy tokens made context as too old (stale_policy
                            mask_stale_tokens), and the response lengths generated and
                            dropped as stale since the previous step (whether the stale
                            drop falls on the long episodes: `megatron-fr lengths`)
    run_dir/config.yaml     the resolved config

On resume both logs are cut back to the checkpoint's step first: the steps after it are
trained again and logged again, each step once. A run that starts from step 0 (no checkpoint
yet, e.g. killed before its first one) starts both logs afresh, as it evaluates step 0 again.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_fr.analysis.run_files import BATCHES_FILE, METRICS_FILE
from megatron_fr.buffer.lag_buffer import LengthRecord
from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator import checkpoints as ckpt
from megatron_fr.orchestrator.run_log import RunLogger, save_resolved_config
from megatron_fr.orchestrator.sinks import build_sinks
from megatron_fr.orchestrator.step_record import StepRecord
from megatron_fr.rollout.service import Evaluation
from megatron_fr.rollout.stats import RolloutStats
from megatron_fr.utils.provenance import run_provenance

if TYPE_CHECKING:
    from megatron_fr.learner.step_metrics import StepMetrics


class RunReport:
    def __init__(
        self, config: RunConfig, run_dir: Path, step: int, checkpoints_set_aside: int = 0
    ) -> None:
        self.run_dir = run_dir
        self.checkpoints_set_aside = checkpoints_set_aside
        """Unusable checkpoints this start found newer than the one it resumed from."""
        for name in (METRICS_FILE, BATCHES_FILE):
            ckpt.truncate_jsonl(run_dir / name, step if step > 0 else -1)
        resolved = config.model_dump(mode="json")
        self.provenance = run_provenance(config.model.hf_dir)
        save_resolved_config(run_dir, resolved, self.provenance)
        sinks = build_sinks(config.report, run_dir, resolved)
        self.logger = RunLogger(run_dir, sinks=sinks, progress_total=config.steps)

    def step(
        self,
        step: int,
        batch: list[TrajectorySummary],
        learner: StepMetrics,
        figures: Mapping[str, float],
        sync_s: float,
        rollout: RolloutStats,
        lengths: LengthRecord,
        seconds: float,
    ) -> None:
        """The step's line of metrics.jsonl (and the sinks) and of batches.jsonl, from its
        record (orchestrator/step_record.py); `figures`: the step's other figures by name
        (every rank's GPUs, the sync check's); `lengths`: the buffer's record since the
        previous step."""
        record = StepRecord.build(
            step, batch, learner, rollout, figures, lengths, sync_s, seconds,
            self.checkpoints_set_aside,
        )  # fmt: skip
        self.logger.log_step(record.metrics_line())
        _append_line(self.run_dir / BATCHES_FILE, record.batch_line())

    def evaluation(self, step: int, evaluation: Evaluation, rollouts_total: int) -> None:
        """One eval line: eval_accuracy (mean over the sets) plus each set's mean and spread,
        eval_failed_episodes (episode tries the pool failed, retried) and eval_incomplete. An
        incomplete evaluation's eval_accuracy is null, with the reason, and printed: a set
        the pool could not serve has no accuracy, never 0."""
        results = evaluation.accuracies
        record: dict[str, Any] = dict(step=step, rollouts_total=rollouts_total)
        record["eval_incomplete"] = int(evaluation.incomplete is not None)
        record["eval_failed_episodes"] = evaluation.failed_episodes
        if evaluation.incomplete is not None:
            record["eval_accuracy"] = None
            record["eval_incomplete_reason"] = evaluation.incomplete
            print(f"step {step}: evaluation incomplete: {evaluation.incomplete}", flush=True)
        else:
            record["eval_accuracy"] = statistics.fmean(mean for mean, _ in results.values())
            if len(results) == 1:
                (record["eval_accuracy_std"],) = (std for _, std in results.values())
        for name, (mean, std) in results.items():
            record[f"eval_{name}_accuracy"] = mean
            record[f"eval_{name}_accuracy_std"] = std
        self.logger.log_eval(record)

    def close(self) -> None:
        self.logger.close()


def _append_line(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
