"""Rollout corrections for the train / inference mismatch: which policy tokens a loss keeps.

The inference engine samples with behaviour log-probs mu that differ from the learner's
log-probs pi of the same weights (other kernels, precision, MoE routing) and, asynchronously,
from older weights. A correction drops the tokens where that mismatch, not the policy,
dominates the gradient (PPOClipConfig.correction selects one for the PPO-clip loss):

    token_mask            keep a policy token if low <= exp(pi - mu) <= high      (IcePop)
    sequence_mask_sum     keep trajectory i whole if low <= exp(S_i) <= high, S_i the sum of
                          pi - mu over its policy tokens (the whole trajectory's ratio)
    sequence_mask_mean    the same with S_i their mean (a per-token geometric mean, independent
                          of length)

Written over segments like the losses (algo/flash_reinforce.py): every token carries the id of
its trajectory, so packed rows and context-parallel slices go through the same code, and a
``reduce_segments`` hook sums the per-trajectory partials of S_i over the ranks that share a
trajectory before the decision (every rank then keeps the same trajectories). Comparisons are
made on the log-ratio against log(low) and log(high), so a ratio that would overflow exp (a
long trajectory's sum) still gets the right decision. Masks are decided on detached values:
a correction selects tokens, it is not differentiated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

CORRECTIONS = ("none", "token_mask", "sequence_mask_sum", "sequence_mask_mean")


def log_bounds(low: float, high: float) -> tuple[float, float]:
    """(log low, log high) of a ratio interval with 0 <= low <= high, high > 0 (inf allowed)."""
    if math.isnan(low) or math.isnan(high) or low < 0 or high <= 0 or low > high:
        raise ValueError(
            f"the ratio interval [low, high] needs 0 <= low <= high and high > 0, "
            f"got low={low}, high={high}"
        )
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def correction_keep_mask(
    log_ratio: Tensor,
    policy: Tensor,
    segment_ids: Tensor,
    num_trajectories: int,
    *,
    correction: str,
    low: float,
    high: float,
    reduce_segments: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Bool mask of the policy tokens `correction` keeps (every one for "none").

    log_ratio: pi - mu (any shape, detached here); policy: bool, the policy tokens given;
    segment_ids: each token's trajectory (global id in [0, num_trajectories), -1 off policy
    tokens); reduce_segments: sums a [2, B] table of per-trajectory partials (sum of the
    log-ratio, token count) over the ranks holding parts of the same trajectories.
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}; known: {list(CORRECTIONS)}")
    if correction == "none":
        return policy
    log_low, log_high = log_bounds(low, high)
    detached = log_ratio.detach()
    if correction == "token_mask":
        return policy & (detached >= log_low) & (detached <= log_high)
    segment = segment_ids[policy]
    totals = torch.zeros(2, num_trajectories, dtype=torch.float64, device=log_ratio.device)
    totals[0].index_add_(0, segment, detached[policy].double())
    totals[1].index_add_(0, segment, torch.ones_like(segment, dtype=torch.float64))
    if reduce_segments is not None:
        totals = reduce_segments(totals)
    statistic = totals[0]
    if correction != "sequence_mask_sum":
        statistic = statistic / totals[1].clamp_min(1)
    inside = (statistic >= log_low) & (statistic <= log_high)
    return policy & inside[segment_ids.clamp_min(0)]
