"""A batch's step plan: what every rank of a step must agree on, computed once from the whole
batch. The trajectories themselves then travel to the DP rank that trains them only.

    plan_step(batch) ─► StepPlan: the micro-batch plan (which trajectory goes to which DP rank,
                        micro-batch and row: learner/micro_batches.py) and the GlobalBatch
                        (advantages over the whole batch, policy-token counts, failures)
    step.share(dp_rank) ─► the batch indices that DP rank trains

Both are small (a few numbers per trajectory), so they can be sent to every rank; the
trajectories' tokens (and routed experts) are what only a share of the ranks needs
(buffer/shards.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_fr.algo.advantages import compute_advantages
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.learner.micro_batches import MicroBatchPlan, plan_micro_batches
from megatron_fr.parallel.loss import GlobalBatch


@dataclass(frozen=True)
class StepPlan:
    plan: MicroBatchPlan
    global_batch: GlobalBatch

    @property
    def size(self) -> int:
        """B: trajectories in the step's batch."""
        return self.global_batch.num_trajectories

    @property
    def policy_tokens(self) -> int:
        counts = self.global_batch.token_counts
        assert counts is not None  # global_batch_of sets them
        return int(counts.sum())

    def share(self, dp_rank: int) -> list[int]:
        """The batch indices of the trajectories DP rank `dp_rank` trains, ascending."""
        rank = self.plan.assignment[dp_rank]
        return sorted(i for micro in rank for row in micro for i in row)


def whole_groups(batch: list[Trajectory]) -> torch.Tensor:
    """int64 group index per trajectory, from info["group"] (the G rollouts of one problem
    share it). The buffer hands out whole groups only; a batch with groups of different sizes
    would give group baselines a different estimator, so it is refused."""
    names = [str(t.info.get("group", t.prompt_id)) for t in batch]
    index = {name: i for i, name in enumerate(dict.fromkeys(names))}
    groups = torch.tensor([index[name] for name in names], dtype=torch.int64)
    sizes = torch.bincount(groups)
    if sizes.min() != sizes.max() or sizes.min() < 2:
        raise ValueError(
            f"group estimators need whole groups of equal size >= 2; this batch has group "
            f"sizes {sorted(set(sizes.tolist()))}"
        )
    return groups


def global_batch_of(batch: list[Trajectory], config: LearnerConfig) -> GlobalBatch:
    """Advantages over the whole batch (the configured estimator), failures for the
    negative-token filter, and each trajectory's policy-token count."""
    rewards = torch.tensor([t.reward for t in batch], dtype=torch.float64)
    failures = rewards <= 0 if config.flash_reinforce.negative_token_fraction < 1 else None
    counts = torch.tensor([t.num_policy_tokens for t in batch], dtype=torch.int64)
    if config.estimator == "flash_reinforce":
        advantages = compute_advantages("flash_reinforce", rewards)
    else:
        advantages = compute_advantages(config.estimator, rewards, whole_groups(batch))
    # A trajectory left out of the loss (a truncated response under `truncated: mask`)
    # keeps its place in B and in the baseline, with advantage 0: no gradient.
    masked = torch.tensor([bool(t.info.get("loss_masked")) for t in batch])
    advantages = advantages.masked_fill(masked, 0.0)
    return GlobalBatch(advantages=advantages.float(), failures=failures, token_counts=counts)


def plan_step(
    batch: list[Trajectory], config: LearnerConfig, parallel: ParallelConfig, dp_size: int
) -> StepPlan:
    """The step plan of `batch` for a learner of this layout (DP size given: it depends on
    the world size)."""
    plan = plan_micro_batches(
        [t.length for t in batch],
        dp_size=dp_size,
        micro_batch_tokens=config.micro_batch_tokens,
        pack=config.pack_sequences,
        cp_size=parallel.context,
        sequence_parallel_size=parallel.tensor if parallel.sequence_parallel else 1,
    )
    return StepPlan(plan, global_batch_of(batch, config))
