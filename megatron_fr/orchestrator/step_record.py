"""One optimizer step's record, built in one place from what the step's parts report:

    the trained batch (TrajectorySummary)  ┐
    the learner's StepMetrics              ├─► StepRecord.build ─► metrics_line()
    the rollout side's RolloutStats        │      ─► RunLogger.log_step (metrics.jsonl, the
    the step's other figures, its lengths  ┘         progress bar, TensorBoard, W&B alike)
                                                  └► batch_line() ─► batches.jsonl

The fixed figures are fields (a figure renamed in one part is a type error here, not a
missing key in a plot); the figures whose names depend on the run (each engine's, the GPUs',
the sync check's, the episodes') ride in `extra`.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_fr.buffer.lag_buffer import LengthRecord
from megatron_fr.buffer.stale_tokens import STALE_TOKENS_MASKED
from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.rollout.episodes import episode_metrics
from megatron_fr.rollout.stats import RolloutStats

if TYPE_CHECKING:
    from collections.abc import Mapping

    from megatron_fr.learner.step_metrics import StepMetrics


@dataclass(frozen=True)
class StepRecord:
    step: int
    policy_version: int
    reward_mean: float
    acceptance_rate: float
    clip_fraction: float
    padding_fraction: float
    dp_imbalance: float
    sequence_kl_mean: float
    retained_tokens_mean: float
    lag_mean: float
    lag_max: int
    tokens_per_s: float
    response_length_mean: float
    rollouts_total: int
    batch_rollouts: int
    loss: float
    grad_norm: float
    adam_step_min: float
    adam_step_max: float
    lr: float
    sync_s: float
    step_s: float
    buffer_occupancy: int
    dropped_total: int
    stale_tokens_masked_total: int
    discarded_total: int
    abandoned_total: int
    groups_failed_total: int
    rollout_failures_total: int
    checkpoints_set_aside: int
    step_skipped: float
    skipped_steps_total: int
    extra: dict[str, float]
    """Figures named by the run: the engines', the step's others (GPUs, sync check), the
    episodes' (text tasks)."""
    batch: dict[str, Any]
    """The batches.jsonl line: per trajectory its prompt, lengths, versions, reward,
    advantage, the gate's KL and decision and its gradient-carrying tokens."""

    @classmethod
    def build(
        cls,
        step: int,
        batch: list[TrajectorySummary],
        learner: StepMetrics,
        rollout: RolloutStats,
        figures: Mapping[str, float],
        lengths: LengthRecord,
        sync_s: float,
        seconds: float,
        checkpoints_set_aside: int,
    ) -> StepRecord:
        lags = [step - 1 - t.oldest_version for t in batch]
        return cls(
            step=step,
            policy_version=step,
            reward_mean=statistics.fmean(t.reward for t in batch),
            acceptance_rate=learner["acceptance_rate"],
            clip_fraction=learner["clip_fraction"],
            padding_fraction=learner["padding_fraction"],
            dp_imbalance=learner["dp_imbalance"],
            sequence_kl_mean=learner["sequence_kl_mean"],
            retained_tokens_mean=learner["retained_tokens_mean"],
            lag_mean=statistics.fmean(lags),
            lag_max=max(lags),
            tokens_per_s=sum(t.length for t in batch) / seconds,
            response_length_mean=statistics.fmean(t.num_policy_tokens for t in batch),
            rollouts_total=rollout.rollouts_total,
            batch_rollouts=len(batch),
            loss=learner["loss"],
            grad_norm=learner["grad_norm"],
            adam_step_min=learner["adam_step_min"],
            adam_step_max=learner["adam_step_max"],
            lr=learner["lr"],
            sync_s=sync_s,
            step_s=seconds,
            buffer_occupancy=rollout.occupancy,
            dropped_total=rollout.dropped_total,
            stale_tokens_masked_total=rollout.stale_tokens_masked_total,
            discarded_total=rollout.discarded_total,
            abandoned_total=rollout.abandoned_total,
            groups_failed_total=rollout.groups_failed_total,
            rollout_failures_total=rollout.rollout_failures_total,
            checkpoints_set_aside=checkpoints_set_aside,
            step_skipped=learner["step_skipped"],
            skipped_steps_total=learner["skipped_steps_total"],
            extra={**rollout.engines, **figures, **episode_metrics(batch)},
            batch={
                "step": step,
                "prompt_ids": [t.prompt_id for t in batch],
                "response_lengths": [t.num_policy_tokens for t in batch],
                "stale_tokens_masked": [t.info.get(STALE_TOKENS_MASKED, 0) for t in batch],
                "oldest_versions": [t.oldest_version for t in batch],
                "rewards": [t.reward for t in batch],
                "advantages": learner["advantages"],
                "admitted": learner["admitted"],
                "sequence_kl": learner["sequence_kl"],
                "retained_tokens": learner["retained_tokens"],
                "generated_lengths": lengths.generated,
                "dropped_stale_lengths": lengths.dropped_stale,
            },
        )

    def metrics_line(self) -> dict[str, Any]:
        """metrics.jsonl's line (and every sink's): the fields in order, then `extra`."""
        fields = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "batch")
        }
        return {**fields, **self.extra}

    def batch_line(self) -> dict[str, Any]:
        return self.batch
