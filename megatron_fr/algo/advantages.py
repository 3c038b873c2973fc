"""Advantage estimators: FlashREINFORCE's batch baseline and the baselines it is compared with.

Sequence-level estimators map rewards R [N] (and, for the group ones, a group id per rollout)
to one advantage per trajectory; they share one signature and sit in ADVANTAGE_ESTIMATORS,
keyed by the name a config selects (compute_advantages dispatches). With G rollouts of prompt g:

    flash_reinforce      A = R - mean_batch(R)                     (no groups: docs/algorithm.md)
    grpo                 A = (R - mean_g) / (std_g + eps)           std_g: sample std (G - 1)
    dr_grpo              A = R - mean_g
    rloo                 A = R - (sum_g R - R) / (G - 1)            leave-one-out mean
    reinforce_baseline   A = whiten_batch(R - mean_g)        whiten: population std

Every estimator is selectable as learner.estimator (config/learner.py). There are no token-level
estimators: GAE needs a critic's values and REINFORCE++'s KL-shaped token rewards a reference
model's log-probs, and this learner trains neither (FlashREINFORCE is critic-free and
reference-free); REINFORCE++'s group-baseline form is reinforce_baseline.

Advantages are constants of the policy loss, so every estimator returns a detached tensor.
Statistics are computed in float64 and cast back to the rewards' dtype: in float32 the mean
of [0.9, 0.9, 0.9] is not 0.9, and GRPO would turn that rounding noise into A = 6e-8 / eps =
0.06 on a group that carries no signal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from megatron_fr.algo import checks

AdvantageEstimator = Literal["flash_reinforce", "grpo", "dr_grpo", "rloo", "reinforce_baseline"]
"""Names of the sequence-level estimators, the keys of ADVANTAGE_ESTIMATORS."""


def _check_eps(eps: float) -> None:
    # eps > 0 is what keeps a group (or batch) of identical rewards at A = 0 instead of 0 / 0.
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")


def _check_batch(rewards: Tensor) -> None:
    checks.check_rewards(rewards)
    if rewards.numel() == 0:
        raise ValueError("rewards is empty (N = 0); an advantage needs at least one rollout")


def _whiten(values: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) with the population std: the result has unit variance."""
    return (values - values.mean()) / (values.std(correction=0) + eps)


class _Groups:
    """Rollouts grouped by prompt id: inverse [N] maps each rollout to its group 0..K-1."""

    def __init__(self, estimator: str, rewards: Tensor, group_index: Tensor | None) -> None:
        _check_batch(rewards)
        if group_index is None:
            raise ValueError(f"{estimator} needs group_index (the prompt id of each rollout)")
        if group_index.dtype != torch.int64:
            raise ValueError(f"group_index must be torch.int64, got {group_index.dtype}")
        if group_index.shape != rewards.shape:
            raise ValueError(
                f"group_index has shape {tuple(group_index.shape)}, expected "
                f"{tuple(rewards.shape)} (the shape of rewards)"
            )
        ids, self.inverse, self.sizes = torch.unique(
            group_index, return_inverse=True, return_counts=True
        )
        single = ids[self.sizes == 1]
        if single.numel():
            raise ValueError(
                f"{estimator}: group {single[:8].tolist()} has a single rollout; a group "
                "baseline needs G >= 2 rollouts per prompt"
            )

    def sum(self, values: Tensor) -> Tensor:
        """Per-rollout sum over its group of ``values`` [N]."""
        totals = values.new_zeros(self.sizes.numel()).index_add_(0, self.inverse, values)
        return totals[self.inverse]

    def size(self) -> Tensor:
        """Per-rollout group size G, as a float64 [N]."""
        return self.sizes[self.inverse].double()

    def centered(self, rewards: Tensor) -> Tensor:
        """R - mean_g, in float64."""
        values = rewards.detach().double()
        return values - self.sum(values) / self.size()


def flash_reinforce_advantages(
    rewards: Tensor, group_index: Tensor | None = None, eps: float = 1e-6
) -> Tensor:
    """A = R - mean over the whole batch. group_index and eps are accepted and ignored."""
    _check_batch(rewards)
    values = rewards.detach().double()
    return (values - values.mean()).to(rewards.dtype)


def grpo_advantages(rewards: Tensor, group_index: Tensor | None, eps: float = 1e-6) -> Tensor:
    """A = (R - mean_g) / (std_g + eps), std_g the SAMPLE std (divisor G - 1).

    The sample std is torch.std's default and what the GRPO (DeepSeekMath) reference
    implementations use; it is why G = 1 is refused (0 / 0) rather than silently zero.
    """
    _check_eps(eps)
    groups = _Groups("grpo", rewards, group_index)
    centered = groups.centered(rewards)
    std = (groups.sum(centered.square()) / (groups.size() - 1)).sqrt()
    return (centered / (std + eps)).to(rewards.dtype)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor | None, eps: float = 1e-6) -> Tensor:
    """A = R - mean_g (Dr. GRPO drops GRPO's std division). eps is accepted and ignored."""
    return _Groups("dr_grpo", rewards, group_index).centered(rewards).to(rewards.dtype)


def rloo_advantages(rewards: Tensor, group_index: Tensor | None, eps: float = 1e-6) -> Tensor:
    """A = R - mean of the OTHER G - 1 rewards of the group. eps is accepted and ignored."""
    groups = _Groups("rloo", rewards, group_index)
    values = rewards.detach().double()
    leave_one_out = (groups.sum(values) - values) / (groups.size() - 1)
    return (values - leave_one_out).to(rewards.dtype)


def reinforce_baseline_advantages(
    rewards: Tensor, group_index: Tensor | None, eps: float = 1e-6
) -> Tensor:
    """A = R - mean_g, then whitened over the whole batch with the population std."""
    _check_eps(eps)
    centered = _Groups("reinforce_baseline", rewards, group_index).centered(rewards)
    return _whiten(centered, eps).to(rewards.dtype)


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor, Tensor | None, float], Tensor]] = {
    "flash_reinforce": flash_reinforce_advantages,
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_baseline": reinforce_baseline_advantages,
}


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    group_index: Tensor | None = None,
    *,
    eps: float = 1e-6,
) -> Tensor:
    """Sequence-level advantages [N] of ``rewards`` [N] under the named estimator.

    estimator: one of AdvantageEstimator (a string, as it comes from a config).
    group_index: int64 [N], the prompt id of each rollout (any ids, in any order); required by
    every estimator but flash_reinforce, and every group needs at least two rollouts.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        )
    return ADVANTAGE_ESTIMATORS[estimator](rewards, group_index, eps)
