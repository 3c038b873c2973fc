"""Rollout corrections for the train / inference mismatch, multiplied into a per-token loss.

The inference engine samples with behaviour log-probs mu that differ from the learner's
log-probs pi of the same weights (other kernels, precision, MoE routing) and, asynchronously,
from older weights. Each correction turns the per-token log-ratio pi - mu into a [B, T]
weight to multiply into a per-token policy loss (ppo_clip_loss's correction_weights):

    truncated_importance_weights   min(exp(pi - mu), cap)                       (TIS)
    token_mask_outside             1 if low <= exp(pi - mu) <= high else 0      (IcePop)
    sequence_mask                  the whole row is 1 if low <= exp(S_i) <= high else 0,
                                   S_i = sum (mode "sum") or mean ("mean") of pi - mu over
                                   the row's policy tokens

Every output is DETACHED (a correction reweights the gradient, it is not differentiated) and
zero off policy tokens. Comparisons are made on the log-ratio against log(low) and log(high),
so a ratio that would overflow exp (a long sequence's sum) still gets the right decision.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from megatron_fr.algo import checks


def _log_ratio(log_probs: Tensor, behavior_log_probs: Tensor, action_mask: Tensor) -> Tensor:
    """Validated, detached pi - mu, zero off policy tokens."""
    checks.check_policy_log_probs(
        action_mask, log_probs=log_probs, behavior_log_probs=behavior_log_probs
    )
    return torch.where(action_mask, log_probs.detach() - behavior_log_probs.detach(), 0)


def _log_bounds(low: float, high: float) -> tuple[float, float]:
    """(log low, log high) of a ratio interval with 0 <= low <= high, high > 0 (inf allowed)."""
    if math.isnan(low) or math.isnan(high) or low < 0 or high <= 0 or low > high:
        raise ValueError(
            f"the ratio interval [low, high] needs 0 <= low <= high and high > 0, "
            f"got low={low}, high={high}"
        )
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def truncated_importance_weights(
    log_probs: Tensor, behavior_log_probs: Tensor, action_mask: Tensor, *, cap: float
) -> Tensor:
    """min(exp(pi - mu), cap) on policy tokens (truncated importance sampling).

    Truncating from above bounds the variance a few tokens with pi >> mu would add; tokens
    with pi < mu keep their full down-weighting. cap must be finite and > 0.
    """
    if not (cap > 0 and math.isfinite(cap)):
        raise ValueError(f"cap must be a finite number > 0, got {cap}")
    log_ratio = _log_ratio(log_probs, behavior_log_probs, action_mask)
    # An exp that overflows to inf is truncated to cap like any other large ratio.
    return torch.where(action_mask, log_ratio.exp().clamp_max(cap), 0)


def token_mask_outside(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    action_mask: Tensor,
    *,
    low: float,
    high: float,
) -> Tensor:
    """1 on policy tokens with low <= exp(pi - mu) <= high, 0 elsewhere (IcePop).

    Tokens outside the interval are dropped outright rather than reweighted: their gradient
    is where the mismatch, not the policy, dominates.
    """
    log_low, log_high = _log_bounds(low, high)
    log_ratio = _log_ratio(log_probs, behavior_log_probs, action_mask)
    keep = action_mask & (log_ratio >= log_low) & (log_ratio <= log_high)
    return keep.to(log_probs.dtype)


def sequence_mask(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    action_mask: Tensor,
    *,
    low: float,
    high: float,
    mode: Literal["sum", "mean"],
) -> Tensor:
    """1 on every policy token of rows whose sequence ratio lies in [low, high], else 0.

    The sequence ratio is exp(S_i) with S_i the sum ("sum": the importance ratio of the whole
    trajectory) or the mean ("mean": its per-token geometric mean, independent of length) of
    pi - mu over row i's policy tokens. A row is kept or dropped whole.
    """
    if mode not in ("sum", "mean"):
        raise ValueError(f"unknown sequence_mask mode {mode!r}; known: ['mean', 'sum']")
    log_low, log_high = _log_bounds(low, high)
    log_ratio = _log_ratio(log_probs, behavior_log_probs, action_mask)
    statistic = log_ratio.sum(dim=1)
    if mode == "mean":
        statistic = statistic / action_mask.sum(dim=1)
    keep = (statistic >= log_low) & (statistic <= log_high)
    return (action_mask & keep[:, None]).to(log_probs.dtype)
