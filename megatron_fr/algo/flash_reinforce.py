"""The FlashREINFORCE policy loss (docs/algorithm.md), in one segment-based core.

    L = -(1/B) sum_i (m_i A_i / T_i) sum_t rho_{i,t} pi_{i,t},   rho = exp(pi - mu) detached,
    m_i = [ max(0, mean_t d_{i,t}) <= delta ],  d = Bernoulli KL(exp(mu) || exp(pi)) per token
    (the paper's gate; optionally d = the top-K KL over the engine's K most likely tokens and a
    tail bucket, topk_kl, which is not the paper's).

Everything is written over *segments*: each token carries the id of the trajectory it belongs
to (-1 for none). A plain [B, T] batch is the special case "segment = row"
(flash_reinforce_loss); the parallel path (megatron_fr.parallel.loss) feeds packed rows,
context-parallel slices and micro-batches through the same core and passes a
``reduce_segments`` hook that sums per-trajectory partials over the ranks that share a
trajectory. That hook runs BEFORE the gate decision, so every rank reaches the same m_i, and
the loss of each micro-batch is its share of L (divided by the global B), so that summing over
micro-batches and data-parallel ranks gives exactly L.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_fr.algo import checks
from megatron_fr.algo.advantages import flash_reinforce_advantages
from megatron_fr.algo.precision import in_loss_dtype

PROBABILITY_CLAMP = 1e-6
"""p = exp(mu) and q = exp(pi) are clamped to [1e-6, 1 - 1e-6] inside the Bernoulli KL (and
every bucket of the top-K KL)."""


class RatioOverflowError(FloatingPointError):
    """exp(pi - mu) is not finite on a token that would contribute gradient."""


@dataclass(frozen=True)
class GateResult:
    """Per-trajectory outcome of the trust region, indexed by global trajectory id [B]."""

    sequence_kl: Tensor
    """D_i = max(0, mean_t d_{i,t}) (0 for trajectories absent from this call)."""
    token_count: Tensor
    """T_i, policy tokens of trajectory i (0 when absent)."""
    admitted: Tensor
    """m_i (bool); False for absent trajectories."""

    @property
    def present(self) -> Tensor:
        return self.token_count > 0


def bernoulli_kl(behavior_log_probs: Tensor, log_probs: Tensor) -> Tensor:
    """Per-token d = p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(mu), q = exp(pi), clamped."""
    low, high = PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP
    p = behavior_log_probs.exp().clamp(low, high)
    q = log_probs.exp().clamp(low, high)
    return p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


def topk_kl(behavior_top: Tensor, current_top: Tensor) -> Tensor:
    """Per-token KL(mu || pi) over K + 1 buckets: the engine's K most likely tokens, and the
    rest of the vocabulary as one tail bucket (1 - the head's mass), both distributions'
    bucket probabilities clamped to [1e-6, 1 - 1e-6] like the Bernoulli proxy's (with K = 1
    it IS the Bernoulli proxy, of the top token). behavior_top, current_top: [..., K]
    log-probs of the same ids under mu (as the engine reported them) and pi."""
    low, high = PROBABILITY_CLAMP, 1.0 - PROBABILITY_CLAMP

    def buckets(log_probs: Tensor) -> Tensor:
        tail = -torch.expm1(torch.logsumexp(log_probs, dim=-1, keepdim=True))
        return torch.cat([log_probs.exp(), tail], dim=-1).clamp(low, high)

    p, q = buckets(behavior_top), buckets(current_top)
    return (p * (p.log() - q.log())).sum(dim=-1)


def trust_region_gate(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor,
    num_trajectories: int,
    delta: float,
    reduce_segments: Callable[[Tensor], Tensor] | None = None,
) -> GateResult:
    """Decide m_i for every trajectory present in the tokens given.

    ``reduce_segments`` receives a [2, B] tensor (sum of d, token count per trajectory) and
    must return its sum over every rank holding tokens of the same trajectories (context
    parallelism); by default the tokens given are the whole trajectories.
    """
    kl = bernoulli_kl(in_loss_dtype(behavior_log_probs.detach()), in_loss_dtype(log_probs.detach()))
    return sequence_gate(kl, action_mask, segment_ids, num_trajectories, delta, reduce_segments)


def sequence_gate(
    token_kl: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor,
    num_trajectories: int,
    delta: float,
    reduce_segments: Callable[[Tensor], Tensor] | None = None,
) -> GateResult:
    """m_i from any per-token KL d (detached): D_i = max(0, mean of d over trajectory i's
    policy tokens), admitted iff D_i <= delta; reduce_segments as for trust_region_gate."""
    tokens = action_mask & (segment_ids >= 0)
    kl = token_kl.detach()
    # every position, the others adding exact zeros: no data-dependent shape (a rehearsal
    # under fake tensors needs none, nor does a GPU want the sync of a boolean index)
    segment = torch.where(tokens, segment_ids, 0).flatten()
    partial = torch.zeros(2, num_trajectories, dtype=kl.dtype, device=kl.device)
    partial[0].index_add_(0, segment, torch.where(tokens, kl, 0).flatten())
    partial[1].index_add_(0, segment, tokens.flatten().to(kl.dtype))
    if reduce_segments is not None:
        partial = reduce_segments(partial)
    kl_sum, token_count = partial[0], partial[1]
    present = token_count > 0
    sequence_kl = torch.where(present, kl_sum / token_count.clamp_min(1), 0).clamp_min(0)
    admitted = present & (sequence_kl <= delta)
    return GateResult(sequence_kl=sequence_kl, token_count=token_count, admitted=admitted)


def negative_token_keep_mask(
    entropies: Tensor,
    action_mask: Tensor,
    segment_ids: Tensor,
    positions: Tensor,
    failures: Tensor,
    fraction: float,
) -> Tensor:
    """Keep mask of the negative-token filter (docs/algorithm.md step 5), same shape as the mask.

    A failed trajectory keeps its ceil(q * T_i) highest-entropy policy tokens; ties go to the
    earlier position, so the choice is the same however the tokens are laid out. All tokens of
    each trajectory must be given (context-parallel callers gather them first). Other policy
    tokens are all kept.
    """
    tokens = action_mask & (segment_ids >= 0)
    keep = tokens.clone()
    if fraction >= 1.0:
        return keep
    segment, entropy, position = segment_ids[tokens], entropies[tokens], positions[tokens]
    # Lexicographic sort by (segment, -entropy, position) via three stable sorts.
    order = torch.argsort(position, stable=True)
    order = order[torch.argsort(-entropy[order], stable=True)]
    order = order[torch.argsort(segment[order], stable=True)]
    counts = torch.bincount(segment, minlength=failures.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - starts[segment[order]]
    # round() absorbs float noise such as 0.3 * 10 = 3.0000000000000004 before the ceil.
    quota = torch.ceil(torch.round(fraction * counts.double(), decimals=9)).long()
    kept = ~failures[segment] | (rank < quota[segment])
    keep[tokens] = kept
    return keep


def importance_ratios(
    log_probs: Tensor, behavior_log_probs: Tensor, contributing: Tensor
) -> Tensor:
    """rho = exp(pi - mu), detached and unclipped; raises if it overflows where it counts."""
    ratios = (log_probs.detach() - behavior_log_probs.detach()).exp()
    overflow = contributing & ~torch.isfinite(ratios)
    if overflow.any():
        where = overflow.nonzero()[0].tolist()
        worst = (log_probs.detach() - behavior_log_probs.detach())[overflow].max().item()
        raise RatioOverflowError(
            f"importance ratio exp(pi - mu) overflows on an admitted token at index {where} "
            f"(log-ratio {worst:.4g}); the behaviour log-probs do not match this policy"
        )
    return torch.where(contributing, ratios, 0)


def segment_policy_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    gate: GateResult,
    advantages: Tensor,
    keep: Tensor,
    segment_ids: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """-(1/B) sum over kept tokens of (m_i A_i / T_i) rho pi, in float32 at least whatever
    the inputs' dtype (algo/precision.py; the loss is returned in that dtype).

    Returns (loss, ratios, contributing): ratios are 0 off the contributing tokens, which are
    the kept policy tokens of admitted trajectories.
    """
    log_probs, behavior_log_probs = in_loss_dtype(log_probs), in_loss_dtype(behavior_log_probs)
    advantages = advantages.to(log_probs.dtype)
    num_trajectories = advantages.numel()
    weight = torch.where(gate.admitted, advantages / gate.token_count.clamp_min(1), 0)
    segment = segment_ids.clamp_min(0)
    contributing = keep & gate.admitted[segment]
    ratios = importance_ratios(log_probs, behavior_log_probs, contributing)
    token_weight = torch.where(contributing, weight[segment] * ratios, 0)
    loss = -(token_weight * torch.where(contributing, log_probs, 0)).sum() / num_trajectories
    return loss, ratios, contributing


def gate_metrics(
    gate: GateResult, ratios: Tensor, contributing: Tensor, segment_ids: Tensor
) -> dict[str, Tensor]:
    """Diagnostics (docs/algorithm.md) for the trajectories in ``gate`` (NaN where none are);
    retained_per_trajectory [B]: each trajectory's tokens that carry gradient here (the
    per-row statistic the paper's reference loss reports, beside the total)."""
    present, kl = gate.present, gate.sequence_kl
    return {
        "retained_per_trajectory": tokens_per_trajectory(
            contributing, segment_ids, gate.admitted.numel()
        ),
        "acceptance_rate": _masked_mean(gate.admitted.double(), present),
        "sequence_kl": kl,
        "sequence_kl_mean": _masked_mean(kl, present),
        "sequence_kl_max": _masked_max(kl, present),
        "admitted": gate.admitted,
        "retained_tokens": contributing.sum(),
        "ratio_mean": _masked_mean(ratios, contributing),
        "ratio_max": _masked_max(ratios, contributing),
    }


def tokens_per_trajectory(mask: Tensor, segment_ids: Tensor, num_trajectories: int) -> Tensor:
    """[B] int64: how many tokens of `mask` each trajectory has (fixed shapes)."""
    counts = torch.zeros(num_trajectories, dtype=torch.int64, device=mask.device)
    segment = torch.where(mask, segment_ids, 0).flatten()
    return counts.index_add_(0, segment, mask.flatten().to(torch.int64))


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values[mask], NaN where the mask is empty; fixed shapes (no boolean index,
    whose output size depends on the data)."""
    return torch.where(mask, values, 0).sum() / mask.sum()


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of values[mask], NaN where the mask is empty; fixed shapes."""
    top = torch.where(mask, values, -math.inf).amax()
    return torch.where(mask.any(), top, math.nan)


def check_filter_inputs(
    fraction: float, entropies: Tensor | None, failures: Tensor | None, log_probs: Tensor
) -> None:
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise ValueError(f"negative_token_fraction q must be in [0, 1], got {fraction}")
    if fraction == 1.0:
        return
    if entropies is None or failures is None:
        raise ValueError("negative_token_fraction < 1 needs both entropies and failures")
    checks.check_same_shape("log_probs", log_probs, entropies=entropies)
    if not torch.isfinite(entropies).all():
        raise ValueError("entropies has non-finite values")
    if failures.dtype != torch.bool or failures.shape != log_probs.shape[:1]:
        raise ValueError(
            f"failures must be bool of shape [{log_probs.shape[0]}], "
            f"got {failures.dtype} {tuple(failures.shape)}"
        )


def flash_reinforce_loss(
    log_probs: Tensor,
    behavior_log_probs: Tensor,
    rewards: Tensor,
    action_mask: Tensor,
    *,
    delta: float = 3e-3,
    negative_token_fraction: float = 1.0,
    entropies: Tensor | None = None,
    failures: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE on one complete batch of B trajectories, one per row of [B, T].

    log_probs: current-policy log-probs of the sampled tokens (carries the gradient);
    behavior_log_probs: the inference engine's log-probs of the same tokens; rewards: [B];
    action_mask: bool [B, T], True on policy tokens. Returns (loss, metrics), computed in
    float32 at least; metrics include acceptance_rate, sequence_kl [B], admitted [B],
    advantages [B], retained_tokens and retained_per_trajectory [B].
    """
    checks.check_policy_log_probs(
        action_mask, log_probs=log_probs, behavior_log_probs=behavior_log_probs
    )
    checks.check_rewards(rewards, action_mask.shape[0])
    checks.check_non_negative(delta=delta)
    check_filter_inputs(negative_token_fraction, entropies, failures, log_probs)

    batch, length = action_mask.shape
    segment_ids = torch.arange(batch, device=action_mask.device)[:, None].expand(batch, length)
    advantages = flash_reinforce_advantages(in_loss_dtype(rewards))
    gate = trust_region_gate(log_probs, behavior_log_probs, action_mask, segment_ids, batch, delta)
    keep = action_mask
    if negative_token_fraction < 1.0:
        positions = torch.arange(length, device=action_mask.device).expand(batch, length)
        assert entropies is not None and failures is not None  # check_filter_inputs: q < 1
        keep = negative_token_keep_mask(
            entropies, action_mask, segment_ids, positions, failures, negative_token_fraction
        )
    loss, ratios, contributing = segment_policy_loss(
        log_probs, behavior_log_probs, gate, advantages, keep, segment_ids
    )
    metrics = gate_metrics(gate, ratios, contributing, segment_ids)
    metrics["advantages"] = advantages.detach()
    return loss, metrics
