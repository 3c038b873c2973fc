"""The PPO / GRPO clipped-ratio policy loss, the baseline FlashREINFORCE is compared against.

Per policy token, with ratio r = exp(log_probs - old_log_probs) and advantage A:

    loss_t = -min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A) * w_t

where w_t are optional rollout-correction weights (megatron_fr.algo.corrections), then
aggregated as a token mean (every policy token of the batch weighs the same: GRPO as
DAPO / Dr. GRPO write it) or a sample mean (every trajectory weighs the same: the original
GRPO). The gradient flows through log_probs only; it is -A r w_t / normaliser where the
unclipped branch is the minimum and 0 where the clipped one is.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megatron_fr.algo import checks
from megatron_fr.algo.flash_reinforce import RatioOverflowError

Aggregation = Literal["token_mean", "sample_mean"]


def _check_advantages(advantages: Tensor, action_mask: Tensor) -> None:
    """[B] (one per trajectory, broadcast over its tokens) or [B, T]; finite where used."""
    batch = action_mask.shape[0]
    if advantages.shape not in (torch.Size([batch]), action_mask.shape):
        raise ValueError(
            f"advantages must be [B] = [{batch}] or [B, T] = {list(action_mask.shape)}, "
            f"got shape {tuple(advantages.shape)}"
        )
    used = advantages if advantages.dim() == 1 else advantages[action_mask]
    if not torch.isfinite(used).all():
        raise ValueError("advantages has non-finite values")


def _check_correction_weights(weights: Tensor, action_mask: Tensor) -> None:
    checks.check_float(correction_weights=weights)
    checks.check_same_shape("action_mask", action_mask, correction_weights=weights)
    used = weights.detach()[action_mask]
    if not (torch.isfinite(used).all() and (used >= 0).all()):
        raise ValueError("correction_weights must be finite and >= 0 on policy tokens")


def _check_inputs(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    correction_weights: Tensor | None,
) -> None:
    checks.check_policy_log_probs(action_mask, log_probs=log_probs, old_log_probs=old_log_probs)
    checks.check_float(advantages=advantages)
    _check_advantages(advantages, action_mask)
    checks.check_non_negative(eps_low=eps_low, eps_high=eps_high)
    if aggregation not in ("token_mean", "sample_mean"):
        raise ValueError(
            f"unknown aggregation {aggregation!r}; known: ['sample_mean', 'token_mean']"
        )
    if correction_weights is not None:
        _check_correction_weights(correction_weights, action_mask)


def _ratio(log_probs: Tensor, old_log_probs: Tensor, action_mask: Tensor) -> Tensor:
    """exp(log_probs - old_log_probs) on policy tokens, 1 elsewhere; raises on overflow.

    Padding may hold anything: masking the log-ratio BEFORE exp keeps its values out of the
    loss and its gradient. An overflowing ratio on a policy token would turn the gradient into
    NaN (0 * inf through the clipped branch), so it is reported instead.
    """
    log_ratio = torch.where(action_mask, log_probs - old_log_probs.detach(), 0)
    ratio = log_ratio.exp()
    if not torch.isfinite(ratio.detach()).all():
        worst = log_ratio.detach().max().item()
        raise RatioOverflowError(
            f"ratio exp(log_probs - old_log_probs) overflows on a policy token (log-ratio "
            f"{worst:.4g}); old_log_probs do not come from a policy close to this one"
        )
    return ratio


def _aggregate(token_loss: Tensor, action_mask: Tensor, aggregation: Aggregation) -> Tensor:
    mask = action_mask.to(token_loss.dtype)
    if aggregation == "token_mean":
        return token_loss.sum() / mask.sum()
    return (token_loss.sum(dim=1) / mask.sum(dim=1)).mean()


def _metrics(ratio: Tensor, clipped: Tensor, action_mask: Tensor) -> dict[str, Tensor]:
    """Diagnostics over policy tokens, unweighted by any correction."""
    ratios = ratio.detach()[action_mask]
    return {
        "clip_fraction": clipped[action_mask].to(ratios.dtype).mean(),
        # k3 = (r - 1) - log r >= 0: an unbiased, low-variance estimate of KL(old || new).
        "approx_kl": ((ratios - 1) - ratios.log()).mean(),
        "ratio_mean": ratios.mean(),
        "ratio_max": ratios.max(),
    }


def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: Aggregation = "token_mean",
    correction_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped-ratio loss over a [B, T] batch; returns (loss, metrics).

    log_probs: current-policy log-probs (carries the gradient); old_log_probs: those of the
    policy the ratio is taken against (the behaviour policy, or the learner's own at the
    start of the step); advantages: [B] or [B, T]; action_mask: bool [B, T], True on policy
    tokens; correction_weights: [B, T] rollout-correction weights or masks, used detached.
    metrics: clip_fraction (share of policy tokens where the clipped branch is the minimum,
    i.e. whose gradient is zeroed), approx_kl, ratio_mean, ratio_max.
    """
    _check_inputs(
        log_probs,
        old_log_probs,
        advantages,
        action_mask,
        eps_low,
        eps_high,
        aggregation,
        correction_weights,
    )
    ratio = _ratio(log_probs, old_log_probs, action_mask)
    # Zero everything off policy tokens first, so whatever padding holds never meets the loss.
    advantage = advantages.detach()
    if advantage.dim() == 1:
        advantage = advantage[:, None]
    advantage = torch.where(action_mask, advantage, 0)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantage
    token_loss = -torch.minimum(unclipped, clipped)
    if correction_weights is not None:
        token_loss = token_loss * torch.where(action_mask, correction_weights.detach(), 0)
    loss = _aggregate(token_loss, action_mask, aggregation)
    return loss, _metrics(ratio, (clipped < unclipped).detach(), action_mask)
