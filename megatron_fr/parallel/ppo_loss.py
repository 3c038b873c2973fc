"""The PPO-clip loss (GRPO, Dr. GRPO, RLOO baselines) as the learner calls it: one micro-batch
on one rank, the same inputs as the parallel FlashREINFORCE loss (parallel/loss.py).

Per policy token, with r = exp(pi - mu) against the BEHAVIOUR log-probs mu the engine
reported (asynchronous PPO takes the ratio against the policy that sampled) and the token's
trajectory advantage A:

    l_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * c_t

c_t is an optional rollout correction (algo/corrections.py's rules, applied on the parallel
layout): a token mask outside [low, high] of r (IcePop), or a mask of whole trajectories
whose sum / mean log-ratio lies outside [log low, log high] (its per-trajectory sums are
reduced over the context-parallel group before the decision, like the FlashREINFORCE gate).

Aggregation, each as its estimator defines it, with every normaliser taken over the WHOLE
batch (GlobalBatch, computed before any split) so that the sum over micro-batches and ranks
is the loss of the batch:
    token_mean       sum_t l_t / (policy tokens in the batch)           DAPO, verl "token-mean"
    sequence_mean    (1/B) sum_i (1/T_i) sum_t l_t                      GRPO as published
    token_sum_norm   (1/B) sum_i (1/T_max) sum_t l_t, T_max the longest  Dr. GRPO
                     trajectory's policy tokens (no per-length weighting)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fr.algo.flash_reinforce import RatioOverflowError, trust_region_gate
from megatron_fr.config.algo import PPOClipConfig
from megatron_fr.parallel.loss import GlobalBatch, LossBatch, check_loss_inputs, sum_over
from megatron_fr.parallel.vocab_parallel import vocab_parallel_log_probs


def token_weights(global_batch: GlobalBatch, config: PPOClipConfig) -> Tensor:
    """[B]: the factor each token of trajectory i is summed with (see the module doc)."""
    counts = global_batch.token_counts.to(torch.float64)
    trajectories = global_batch.num_trajectories
    if config.aggregation == "token_mean":
        return torch.full_like(counts, 1.0 / max(counts.sum().item(), 1.0))
    if config.aggregation == "sequence_mean":
        return 1.0 / (trajectories * counts.clamp_min(1))
    return torch.full_like(counts, 1.0 / (trajectories * max(counts.max().item(), 1.0)))


def _log_ratio(log_probs: Tensor, behavior: Tensor, policy: Tensor) -> Tensor:
    log_ratio = torch.where(policy, log_probs - behavior, 0)
    if not torch.isfinite(log_ratio.detach().exp()).all():
        worst = log_ratio.detach().max().item()
        raise RatioOverflowError(
            f"ratio exp(pi - mu) overflows on a policy token (log-ratio {worst:.4g}); the "
            "behaviour log-probs do not come from a policy close to this one"
        )
    return log_ratio


def _correction(log_ratio: Tensor, batch: LossBatch, policy: Tensor, config, cp_group) -> Tensor:
    """[rows, S] bool: the tokens the correction keeps (all policy tokens when off)."""
    if config.correction == "none":
        return policy
    low = math.log(config.correction_low) if config.correction_low > 0 else -math.inf
    high = math.log(config.correction_high)
    detached = log_ratio.detach()
    if config.correction == "token_mask":
        return policy & (detached >= low) & (detached <= high)
    segments = batch.segment_ids.clamp_min(0)[policy]
    size = int(batch.segment_ids.max().item()) + 1 if policy.any() else 0
    size = max(size, 1)
    totals = torch.zeros(2, size, dtype=torch.float64, device=log_ratio.device)
    totals[0].index_add_(0, segments, detached[policy].double())
    totals[1].index_add_(0, segments, torch.ones_like(segments, dtype=torch.float64))
    statistic = _cp_segment_sums(totals, cp_group)
    value = statistic[0] if config.correction == "sequence_mask_sum" else (
        statistic[0] / statistic[1].clamp_min(1)
    )  # fmt: skip
    kept = (value >= low) & (value <= high)
    return policy & kept[batch.segment_ids.clamp_min(0)]


def _cp_segment_sums(totals: Tensor, cp_group) -> Tensor:
    """Per-trajectory sums over the CP group; segment ids are global, so every CP rank sizes
    its table to the largest id any rank holds first."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return totals
    size = torch.tensor([totals.shape[1]], device=totals.device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=cp_group)
    padded = torch.nn.functional.pad(totals, (0, int(size) - totals.shape[1]))
    dist.all_reduce(padded, group=cp_group)
    return padded


def ppo_clip_parallel_loss(
    logits: Tensor,
    batch: LossBatch,
    global_batch: GlobalBatch,
    config: PPOClipConfig,
    *,
    tp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the batch's PPO-clip loss, and its metrics."""
    check_loss_inputs(batch, global_batch)
    if global_batch.token_counts is None:
        raise ValueError("the PPO-clip loss needs GlobalBatch.token_counts")
    log_probs, _ = vocab_parallel_log_probs(logits, batch.target_ids, tp_group)
    behavior = batch.behavior_log_probs.to(log_probs.dtype)
    policy = batch.action_mask & (batch.segment_ids >= 0)
    log_ratio = _log_ratio(log_probs, behavior, policy)
    ratio = log_ratio.exp()
    segment = batch.segment_ids.clamp_min(0)
    advantage = torch.where(policy, global_batch.advantages.to(log_probs.dtype)[segment], 0)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high) * advantage
    kept = _correction(log_ratio, batch, policy, config, cp_group)
    weight = token_weights(global_batch, config).to(log_probs.dtype)[segment]
    loss = -(torch.where(kept, torch.minimum(unclipped, clipped) * weight, 0)).sum()
    present = torch.zeros(global_batch.num_trajectories, dtype=torch.bool, device=logits.device)
    present[batch.segment_ids[policy].unique()] = True
    admitted = torch.zeros_like(present)
    admitted[batch.segment_ids[kept].unique()] = True
    ratios = ratio.detach()[policy]
    # The gate's per-trajectory KL, as a diagnostic only (no gate here): the comparison of
    # methods reports the same engine-learner mismatch for every loss.
    mismatch = trust_region_gate(
        log_probs, behavior, batch.action_mask, batch.segment_ids,
        global_batch.num_trajectories, math.inf, reduce_segments=sum_over(cp_group),
    )  # fmt: skip
    metrics = {
        "sequence_kl": mismatch.sequence_kl,
        "admitted": admitted,
        "present": present,
        "clip_fraction_tokens": ((clipped < unclipped) & policy).sum().detach(),
        "policy_tokens": policy.sum(),
        "ratio_max": ratios.max() if ratios.numel() else ratios.new_tensor(math.nan),
        "log_probs": log_probs.detach(),
    }
    return loss, metrics
