"""The PPO-clip loss of the baselines FlashREINFORCE is compared with (GRPO, Dr. GRPO, RLOO,
REINFORCE-baseline), in one segment-based core: the learner's only PPO-clip loss.

Per policy token t of trajectory i, with r = exp(pi - mu) taken against the BEHAVIOUR
log-probs mu the engine reported (asynchronous PPO takes the ratio against the policy that
sampled) and the trajectory's advantage A_i:

    l_t = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i)     on the tokens the rollout
                                                                  correction keeps (corrections.py)

aggregated with every normaliser taken over the WHOLE batch (B trajectories, T_i policy
tokens each, counted before any split), so that the sum over micro-batches and ranks is the
loss of the batch (PPOClipConfig.aggregation):

    token_mean       sum_i sum_t l_t / sum_i T_i          every policy token weighs the same
                                                          (DAPO, verl's token-mean)
    sequence_mean    (1/B) sum_i (1/T_i) sum_t l_t        every trajectory weighs the same
                                                          (GRPO as published)
    token_sum_norm   (1/B) sum_i (1/T_max) sum_t l_t      Dr. GRPO: token sums over one
                                                          constant, no per-length weighting
                     (Dr. GRPO's constant is its generation budget; here it is T_max, the
                     batch's longest trajectory's policy tokens)

The gradient flows through pi only: -A_i r w_i on a token whose unclipped branch is the
minimum, 0 where the clipped one is. Written over segments like the FlashREINFORCE loss
(algo/flash_reinforce.py): each token carries its trajectory's global id, a plain [B, T]
batch is the case "segment = row", and the parallel learner (parallel/loss.py) passes packed
rows, context-parallel slices and micro-batches with a ``reduce_segments`` hook for the
per-trajectory sums (the sequence corrections, the diagnostic KL).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_fr.algo import checks
from megatron_fr.algo.corrections import correction_keep_mask
from megatron_fr.algo.flash_reinforce import (
    RatioOverflowError,
    tokens_per_trajectory,
    trust_region_gate,
)
from megatron_fr.algo.precision import in_loss_dtype
from megatron_fr.config.algo import PPOClipConfig

AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum_norm")


def token_weights(token_counts: Tensor, aggregation: str) -> Tensor:
    """[B] float64: the factor each token of trajectory i is summed with (module doc)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; known: {list(AGGREGATIONS)}")
    counts = token_counts.to(torch.float64)
    trajectories = counts.numel()
    if aggregation == "token_mean":
        return torch.full_like(counts, 1.0 / max(counts.sum().item(), 1.0))
    if aggregation == "sequence_mean":
        return 1.0 / (trajectories * counts.clamp_min(1))
    return torch.full_like(counts, 1.0 / (trajectories * max(counts.max().item(), 1.0)))


def _log_ratio(log_probs: Tensor, behavior_log_probs: Tensor, policy: Tensor) -> Tensor:
    """pi - mu on policy tokens, 0 elsewhere (so padding never meets exp); raises where exp
    would overflow: the gradient there would be NaN (0 * inf through the clipped branch)."""
    log_ratio = torch.where(policy, log_probs - behavior_log_probs.detach(), 0)
    if not torch.isfinite(log_ratio.detach().exp()).all():
        worst = log_ratio.detach().max().item()
        raise RatioOverflowError(
            f"ratio exp(pi - mu) overflows on a policy token (log-ratio {worst:.4g}); the "
            "behaviour log-probs do not come from a policy close to this one"
        )
    return log_ratio


def _check_inputs(
    log_probs: Tensor,
    behavior: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor,
    token_counts: Tensor,
) -> None:
    checks.check_float(log_probs=log_probs, behavior_log_probs=behavior)
    checks.check_same_shape(
        "log_probs",
        log_probs,
        behavior_log_probs=behavior,
        action_mask=action_mask,
        segment_ids=segment_ids,
    )
    checks.check_same_dtype(log_probs=log_probs, behavior_log_probs=behavior)
    if action_mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be torch.bool, got {action_mask.dtype}")
    policy = action_mask & (segment_ids >= 0)
    if not torch.isfinite(log_probs.detach()[policy]).all():
        raise ValueError("log_probs has non-finite values on policy tokens")
    checks.check_log_probs("behavior_log_probs", behavior, policy)
    checks.check_rewards(advantages, name="advantages")
    if token_counts.shape != advantages.shape:
        raise ValueError(
            f"token_counts has shape {tuple(token_counts.shape)}, expected "
            f"{tuple(advantages.shape)} (one per trajectory, like advantages)"
        )
    checks.check_segment_ids(segment_ids, policy, advantages.numel())


def ppo_clip_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor,
    token_counts: Tensor,
    config: PPOClipConfig,
    reduce_segments: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The share of the batch's PPO-clip loss carried by the tokens given, and its metrics.

    log_probs (carries the gradient), behavior_log_probs, action_mask (bool, True on policy
    tokens), segment_ids (each token's trajectory in [0, B), -1 for padding): same shape, any
    layout; advantages and token_counts: [B], the whole batch's (T_i counted over all of a
    trajectory's tokens, wherever they are). config.aggregation must be resolved (not None).
    Computed in float32 at least (algo/precision.py). Metrics: clipped_tokens and
    policy_tokens (counts here), retained_per_trajectory [B] (tokens kept here, each
    trajectory's), ratio_max, admitted [B] (kept a token here), present [B] (has a policy
    token here), sequence_kl [B] (the FlashREINFORCE gate's D_i, as a diagnostic: it gates
    nothing).
    """
    _check_inputs(log_probs, behavior_log_probs, advantages, action_mask, segment_ids, token_counts)
    log_probs, behavior_log_probs = in_loss_dtype(log_probs), in_loss_dtype(behavior_log_probs)
    if config.aggregation is None:
        raise ValueError("ppo_clip.aggregation is unset (LearnerConfig resolves it)")
    num_trajectories = advantages.numel()
    policy = action_mask & (segment_ids >= 0)
    log_ratio = _log_ratio(log_probs, behavior_log_probs, policy)
    ratio = log_ratio.exp()
    segment = segment_ids.clamp_min(0)
    advantage = torch.where(policy, advantages.detach().to(log_probs.dtype)[segment], 0)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high) * advantage
    kept = correction_keep_mask(
        log_ratio,
        policy,
        segment_ids,
        num_trajectories,
        correction=config.correction,
        low=config.correction_low,
        high=config.correction_high,
        reduce_segments=reduce_segments,
    )
    weight = token_weights(token_counts, config.aggregation).to(log_probs.dtype)[segment]
    loss = -torch.where(kept, torch.minimum(unclipped, clipped) * weight, 0).sum()
    return loss, _metrics(
        log_probs,
        behavior_log_probs,
        policy,
        kept,
        ratio,
        clipped < unclipped,
        segment_ids,
        num_trajectories,
        reduce_segments,
    )


def _metrics(
    log_probs: Tensor,
    behavior: Tensor,
    policy: Tensor,
    kept: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    segment_ids: Tensor,
    trajectories: int,
    reduce_segments: Callable[[Tensor], Tensor] | None,
) -> dict[str, Tensor]:
    present = torch.zeros(trajectories, dtype=torch.bool, device=policy.device)
    present[segment_ids[policy]] = True
    admitted = torch.zeros_like(present)
    admitted[segment_ids[kept]] = True
    ratios = ratio.detach()[policy]
    # The gate's per-trajectory KL, as a diagnostic only: the comparison of methods reports
    # the same engine-learner mismatch for every loss.
    mismatch = trust_region_gate(
        log_probs,
        behavior,
        policy,
        segment_ids,
        trajectories,
        math.inf,
        reduce_segments=reduce_segments,
    )
    return {
        "sequence_kl": mismatch.sequence_kl,
        "admitted": admitted,
        "present": present,
        "clipped_tokens": (clipped & policy).sum().detach(),
        "retained_per_trajectory": tokens_per_trajectory(kept, segment_ids, trajectories),
        "policy_tokens": policy.sum(),
        "ratio_max": ratios.max() if ratios.numel() else ratios.new_tensor(math.nan),
    }
