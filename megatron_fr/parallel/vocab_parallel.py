"""Log-probabilities (and entropies) of target tokens from vocab-parallel logits.

Under tensor parallelism each rank holds logits for a contiguous slice of the vocabulary
(megatron's ColumnParallelLinear output layer, no gather). The log-probability of a target
token needs only three reductions over the tensor-parallel group: the max logit, the sum of
exponentials and the target's logit (which lives on one rank). The full vocabulary is never
materialised.

Unlike megatron's vocab_parallel_cross_entropy, this keeps the input dtype (float64 stays
float64, so parity tests can be exact) and never writes into the caller's logits (the learner
may still need them). Memory: one logits-sized buffer, holding the softmax, saved for
backward and turned into the gradient in place there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogProbs(torch.autograd.Function):
    """Forward: log p(target), optionally the categorical entropy. Backward: into the logits."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group, with_entropy: bool):
        rank, _ = _group_rank_and_size(group)
        shard = logits.shape[-1]
        vocab_start = rank * shard
        compute_dtype = _compute_dtype(logits.dtype)
        logits_max = logits.detach().amax(dim=-1).to(compute_dtype)
        _all_reduce(logits_max, dist.ReduceOp.MAX, group)

        in_shard = (targets >= vocab_start) & (targets < vocab_start + shard)
        local_targets = torch.where(in_shard, targets - vocab_start, 0)
        # The one logits-sized buffer (in float32 at least: bf16 log-probs are too coarse).
        softmax = logits.detach().to(compute_dtype) - logits_max.unsqueeze(-1)
        target_logit = softmax.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        softmax.exp_()
        # [target logit (shifted), sum of exp] reduced in one collective.
        sums = torch.stack([torch.where(in_shard, target_logit, 0), softmax.sum(dim=-1)])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        log_sum_exp = sums[1].log()
        log_probs = sums[0] - log_sum_exp
        softmax.div_(sums[1].unsqueeze(-1))

        entropy = None
        if with_entropy:
            # H = logsumexp(z) - sum_v p_v z_v, with z the max-shifted logits.
            shifted = logits.detach().to(compute_dtype) - logits_max.unsqueeze(-1)
            expected_logit = torch.einsum("...v,...v->...", softmax, shifted)
            _all_reduce(expected_logit, dist.ReduceOp.SUM, group)
            entropy = log_sum_exp - expected_logit
            ctx.mark_non_differentiable(entropy)

        ctx.save_for_backward(softmax, local_targets, in_shard)
        ctx.logits_dtype = logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor, _grad_entropy: Tensor | None):
        softmax, local_targets, in_shard = ctx.saved_tensors
        # d log p(y) / d z_v = [v == y] - p_v; reuses the saved softmax buffer in place.
        grad = softmax
        grad.mul_(-grad_log_probs.unsqueeze(-1))
        grad.scatter_add_(
            -1,
            local_targets.unsqueeze(-1),
            torch.where(in_shard, grad_log_probs, 0).unsqueeze(-1).to(grad.dtype),
        )
        return grad.to(ctx.logits_dtype), None, None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def vocab_parallel_log_probs(
    logits: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) [*] from this rank's vocab shard of the logits [*, V / tp].

    ``group`` is the tensor-parallel group (None: the logits are the whole vocabulary). Every
    rank of the group gets the same log-probs; the gradient flows into each rank's shard.
    With ``with_entropy`` also returns the (detached) entropy of the full categorical.
    The backward may run once (its buffer is consumed), as for any training loss.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    vocab_size = logits.shape[-1] * _group_rank_and_size(group)[1]
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab_size):
        raise ValueError(
            f"targets must be token ids in [0, {vocab_size}); got range "
            f"[{targets.min().item()}, {targets.max().item()}] (set padding targets to 0)"
        )
    return _VocabParallelLogProbs.apply(logits, targets, group, with_entropy)
