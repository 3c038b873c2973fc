"""Advantage estimators: FlashREINFORCE's batch baseline and the baselines it is compared with.

Sequence-level estimators map rewards R [N] (and, for the group ones, a group id per rollout)
to one advantage per trajectory; they share one signature and sit in ADVANTAGE_ESTIMATORS,
keyed by the name a config selects (compute_advantages dispatches). With G rollouts of prompt g:

    flash_reinforce      A = R - mean_batch(R)                     (no groups: docs/algorithm.md)
    grpo                 A = (R - mean_g) / (std_g + eps)           std_g: sample std (G - 1)
    dr_grpo              A = R - mean_g
    rloo                 A = R - (sum_g R - R) / (G - 1)            leave-one-out mean
    reinforce_baseline   A = whiten_batch(R - mean_g)        whiten: population std

Token-level estimators return [B, T] advantages, zero off policy tokens:
reinforce_plus_plus_advantages (KL-shaped token rewards, discounted return, batch-whitened) and
gae_advantages (PPO's GAE; it needs a value per token, i.e. a critic, which this project does
not train: it is here for comparison runs that bring their own values).

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


def _check_token_inputs(action_mask: Tensor, **tensors: Tensor) -> None:
    checks.check_action_mask(action_mask)
    checks.check_float(**tensors)
    checks.check_same_shape("action_mask", action_mask, **tensors)
    checks.check_same_dtype(**tensors)


def _check_finite_on_tokens(action_mask: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor.detach()[action_mask]).all():
            raise ValueError(f"{name} has non-finite values on policy tokens")


def _check_unit_interval(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


def _discounted_return(token_rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_(next policy token), over policy tokens only.

    Tokens that are not the policy's (tool output between turns, padding) are skipped: they
    neither earn reward nor count as a discount step. Zero off policy tokens.
    """
    rewards = torch.where(action_mask, token_rewards, 0)
    if gamma == 1.0:
        # Undiscounted: the return is a reverse cumulative sum, no scan over T needed.
        returns = rewards.flip(1).cumsum(1).flip(1)
        return torch.where(action_mask, returns, 0)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(action_mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(action_mask[:, t], running, 0)
    return returns


def _last_policy_token(action_mask: Tensor) -> Tensor:
    """Column index [B] of each row's last policy token."""
    positions = torch.arange(action_mask.shape[1], device=action_mask.device)
    return torch.where(action_mask, positions, -1).amax(dim=1)


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    action_mask: Tensor,
    *,
    kl_coef: float,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++ token advantages [B, T]: whitened discounted return of KL-shaped rewards.

    Token reward on policy tokens: -kl_coef * (log_probs - ref_log_probs), plus R_i on the
    LAST policy token of row i. The return-to-go runs over policy tokens (discount gamma per
    policy token), then is whitened (population std) over all policy tokens of the batch:
    the batch, not a group, is the baseline. Zero off policy tokens.
    """
    _check_token_inputs(action_mask, log_probs=log_probs, ref_log_probs=ref_log_probs)
    checks.check_log_probs("log_probs", log_probs, action_mask)
    checks.check_log_probs("ref_log_probs", ref_log_probs, action_mask)
    checks.check_rewards(rewards, action_mask.shape[0])
    if not (kl_coef >= 0 and math.isfinite(kl_coef)):
        raise ValueError(f"kl_coef must be a finite number >= 0, got {kl_coef}")
    _check_unit_interval(gamma=gamma)
    _check_eps(eps)

    kl = torch.where(action_mask, log_probs.detach() - ref_log_probs.detach(), 0).double()
    token_rewards = -kl_coef * kl
    rows = torch.arange(action_mask.shape[0], device=action_mask.device)
    token_rewards[rows, _last_policy_token(action_mask)] += rewards.detach().double()
    returns = _discounted_return(token_rewards, action_mask, gamma)
    whitened = _whiten(returns[action_mask], eps)
    advantages = torch.zeros_like(returns).masked_scatter_(action_mask, whitened)
    return advantages.to(log_probs.dtype)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """PPO's generalized advantage estimation over policy tokens: (advantages, returns) [B, T].

    delta_t = r_t + gamma * V_(next policy token) - V_t, with V = 0 after the last policy
    token; A_t = delta_t + gamma * lam * A_(next policy token); returns = A + V (the critic's
    regression target). The outcome reward belongs in token_rewards at the last policy token.
    Tokens that are not the policy's are skipped (their rewards and values are ignored, as in
    the discounted return above) and are zero in both outputs. ``values`` come from a critic,
    which this project does not train (FlashREINFORCE is critic-free): GAE is offered for
    comparison runs that bring their own values.
    """
    _check_token_inputs(action_mask, token_rewards=token_rewards, values=values)
    _check_finite_on_tokens(action_mask, token_rewards=token_rewards, values=values)
    _check_unit_interval(gamma=gamma, lam=lam)

    rewards = token_rewards.detach()
    value = values.detach()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        policy = action_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - value[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = torch.where(policy, advantage, next_advantage)
        next_value = torch.where(policy, value[:, t], next_value)
        advantages[:, t] = torch.where(policy, advantage, 0)
    returns = torch.where(action_mask, advantages + value, 0)
    return advantages, returns
