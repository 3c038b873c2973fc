"""Log-probabilities (and entropies) of target tokens from vocab-parallel logits, without ever
holding the logits of a whole micro-batch.

Under tensor parallelism each rank holds the output layer's rows for a contiguous slice of the
vocabulary (megatron's ColumnParallelLinear, no gather). The log-probability of a target token
needs only two reductions over the tensor-parallel group: the max logit, and [the target's
(shifted) logit, the sum of exponentials] in one collective. The full vocabulary is never
gathered.

The learner's loss path, chunked_vocab_parallel_log_probs, starts from the final hidden states
and the output layer's weight: the logits are made, used and dropped a chunk of tokens at a
time (LOSS_CHUNK_BYTES of fp32 logits per chunk), and each chunk is recomputed in the backward
pass, which turns its softmax into the gradients of the hidden states and of the weight. Peak
memory beyond the inputs and the returned gradients: one chunk's fp32 logits, turned into
their softmax and then their gradient in place (with entropies, a second such buffer; with
a bf16 weight, the bf16 product before its fp32 copy and an fp32 accumulator of the weight's
gradient). vocab_parallel_log_probs is the same computation on logits already made (one chunk):
with a micro-batch that fits in one chunk, the two give bit-identical log-probs and gradients.

The loss path also scores, on request, K more token ids per position (the top-K gate's: the
engine's most likely tokens, parallel/loss.py): their shifted logits join the same collective
as the target's, so they cost no extra reduction and no logits beyond the chunk's; they carry
no gradient (the gate is a decision, not a loss term).

Both keep the input dtype when it is float32 or float64 (parity tests can be exact; bf16 is
computed in float32: bf16 log-probs are too coarse) and never write into the caller's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fr.config.learner import LOSS_CHUNK_BYTES


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(
    tensor: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_Scores = tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor | None]


def _softmax_and_scores(
    logits: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None,
    with_entropy: bool,
    in_place: bool = False,
    ids: Tensor | None = None,
) -> _Scores:
    """(log p(target), entropy or None, softmax, local targets, in-shard mask, log p(ids) or
    None) of [n, V/tp] logits, with `ids` [n, K] more token ids to score. The softmax is one
    fresh logits-sized buffer in the compute dtype, or, in_place (logits of the caller's own,
    in the compute dtype), the logits' buffer itself; with entropies a second buffer lives
    while they are computed. Same values either way."""
    rank, _ = _group_rank_and_size(group)
    shard = logits.shape[-1]
    vocab_start = rank * shard
    compute_dtype = _compute_dtype(logits.dtype)
    logits_max = logits.detach().amax(dim=-1).to(compute_dtype)
    _all_reduce(logits_max, dist.ReduceOp.MAX, group)
    in_shard = (targets >= vocab_start) & (targets < vocab_start + shard)
    local_targets = torch.where(in_shard, targets - vocab_start, 0)
    if in_place:
        softmax = logits.sub_(logits_max.unsqueeze(-1))
        shifted = softmax.clone() if with_entropy else None
    else:
        softmax = logits.detach().to(compute_dtype) - logits_max.unsqueeze(-1)
        shifted = None
    target_logit = softmax.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
    id_logits = None if ids is None else _shard_logits(softmax, ids, vocab_start)
    softmax.exp_()
    # [target logit (shifted), sum of exp (, the ids' logits)] reduced in one collective.
    sums = torch.stack([torch.where(in_shard, target_logit, 0), softmax.sum(dim=-1)])
    if id_logits is not None:
        sums = torch.cat([sums, id_logits.movedim(-1, 0)])
    _all_reduce(sums, dist.ReduceOp.SUM, group)
    log_sum_exp = sums[1].log()
    log_probs = sums[0] - log_sum_exp
    id_log_probs = None if ids is None else (sums[2:] - log_sum_exp).movedim(0, -1)
    softmax.div_(sums[1].unsqueeze(-1))
    entropy: Tensor | None = None
    if with_entropy:
        # H = logsumexp(z) - sum_v p_v z_v, with z the max-shifted logits.
        if shifted is None:
            shifted = logits.detach().to(compute_dtype) - logits_max.unsqueeze(-1)
        expected_logit = torch.einsum("...v,...v->...", softmax, shifted)
        _all_reduce(expected_logit, dist.ReduceOp.SUM, group)
        entropy = log_sum_exp - expected_logit
    return log_probs, entropy, softmax, local_targets, in_shard, id_log_probs


def _shard_logits(shifted: Tensor, ids: Tensor, vocab_start: int) -> Tensor:
    """[n, K] shifted logits of `ids` held by this shard, 0 for the others (the TP sum then
    gives each its logit)."""
    in_shard = (ids >= vocab_start) & (ids < vocab_start + shifted.shape[-1])
    local = torch.where(in_shard, ids - vocab_start, 0).long()
    return torch.where(in_shard, shifted.gather(-1, local), 0)


def _logits_gradient(
    softmax: Tensor, local_targets: Tensor, in_shard: Tensor, grad_log_probs: Tensor
) -> Tensor:
    """d log p(y) / d z_v = [v == y] - p_v, times the incoming gradient, in place of the
    softmax buffer."""
    grad = softmax
    grad.mul_(-grad_log_probs.unsqueeze(-1))
    grad.scatter_add_(
        -1,
        local_targets.unsqueeze(-1),
        torch.where(in_shard, grad_log_probs, 0).unsqueeze(-1).to(grad.dtype),
    )
    return grad


class _VocabParallelLogProbs(torch.autograd.Function):
    """Forward: log p(target), optionally the categorical entropy. Backward: into the logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        group: dist.ProcessGroup | None,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        log_probs, entropy, softmax, local_targets, in_shard, _ = _softmax_and_scores(
            logits, targets, group, with_entropy
        )
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(softmax, local_targets, in_shard)
        ctx.logits_dtype = logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: Tensor, _grad_entropy: Tensor | None
    ) -> tuple[Tensor, None, None, None]:
        softmax, local_targets, in_shard = ctx.saved_tensors
        grad = _logits_gradient(softmax, local_targets, in_shard, grad_log_probs)
        return grad.to(ctx.logits_dtype), None, None, None


def _check_targets(
    targets: Tensor, expected_shape: Sequence[int], vocab_size: int, name: str = "targets"
) -> None:
    if targets.shape != expected_shape:
        raise ValueError(
            f"{name} shape {tuple(targets.shape)} does not match {tuple(expected_shape)}"
        )
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be integer token ids, got {targets.dtype}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab_size):
        raise ValueError(
            f"{name} must be token ids in [0, {vocab_size}); got range "
            f"[{targets.min().item()}, {targets.max().item()}] (set padding {name} to 0)"
        )


def vocab_parallel_log_probs(
    logits: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) [*] from this rank's vocab shard of logits already made [*, V / tp].

    ``group`` is the tensor-parallel group (None: the logits are the whole vocabulary). Every
    rank of the group gets the same log-probs; the gradient flows into each rank's shard.
    With ``with_entropy`` also returns the (detached) entropy of the full categorical.
    The backward may run once (its buffer is consumed), as for any training loss.
    """
    vocab_size = logits.shape[-1] * _group_rank_and_size(group)[1]
    _check_targets(targets, logits.shape[:-1], vocab_size)
    return _VocabParallelLogProbs.apply(logits, targets, group, with_entropy)


def chunk_tokens(vocab_shard: int) -> int:
    """Tokens per chunk of the loss path: LOSS_CHUNK_BYTES of fp32 logits (at least one)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * vocab_shard))


class _ChunkedLogProbs(torch.autograd.Function):
    """Forward: log p(target) (and entropies, and the log-probs of more ids) from hidden
    states, chunk by chunk. Backward: each chunk's logits made again, their gradient turned
    into the hidden states' and the weight's."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        group: dist.ProcessGroup | None,
        temperature: float,
        with_entropy: bool,
        chunk: int,
        ids: Tensor | None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        scores = [  # each chunk's scores only, so its softmax buffer is freed at once
            _chunk_scores(hidden[s], weight, targets[s], group, temperature, with_entropy, ids, s)
            for s in _chunks(hidden.shape[0], chunk)
        ]
        log_probs = torch.cat([score[0] for score in scores])
        entropy = _cat_optional([score[1] for score in scores])
        id_log_probs = _cat_optional([score[2] for score in scores])
        for detached in (entropy, id_log_probs):
            if detached is not None:
                ctx.mark_non_differentiable(detached)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.group, ctx.temperature, ctx.chunk = group, temperature, chunk
        return log_probs, entropy, id_log_probs

    @staticmethod
    def backward(
        ctx: Any, grad_log_probs: Tensor, _grad_entropy: Tensor | None, _grad_ids: Tensor | None
    ) -> tuple[Tensor, Tensor, None, None, None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight: Tensor | None = None
        for s in _chunks(hidden.shape[0], ctx.chunk):
            logits = _logits(hidden[s], weight, ctx.temperature)
            _, _, softmax, local, in_shard, _ = _softmax_and_scores(
                logits, targets[s], ctx.group, False, in_place=True
            )
            del logits
            grad = _logits_gradient(softmax, local, in_shard, grad_log_probs[s])
            grad = _divide(grad, ctx.temperature).to(weight.dtype)
            grad_hidden[s] = grad @ weight
            grad_weight = _accumulate(grad_weight, grad, hidden[s])
        assert grad_weight is not None, "no chunks: the forward fails first (cat of none)"
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def _chunk_scores(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None,
    temperature: float,
    with_entropy: bool,
    ids: Tensor | None,
    chunk: slice,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(log p(targets), entropy or None, log p(ids) or None) of one chunk's logits, made and
    dropped here; `ids` are the whole batch's, sliced to the chunk."""
    logits = _logits(hidden, weight, temperature)
    chunk_ids = None if ids is None else ids[chunk]
    scores = _softmax_and_scores(logits, targets, group, with_entropy, True, chunk_ids)
    return scores[0], scores[1], scores[5]


def _cat_optional(parts: list[Tensor | None]) -> Tensor | None:
    """The chunks' optional scores (entropies, the ids' log-probs) joined, or None where the
    chunks made none (each chunk makes them or not alike)."""
    present = [part for part in parts if part is not None]
    return torch.cat(present) if present else None


def _chunks(tokens: int, chunk: int) -> list[slice]:
    return [slice(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def _logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """One chunk's logits at the temperature, in the compute dtype (what the loss scores)."""
    return _divide((hidden @ weight.t()).to(_compute_dtype(weight.dtype)), temperature)


def _divide(fresh: Tensor, temperature: float) -> Tensor:
    """fresh / temperature, in place (the tensor is this module's own)."""
    return fresh if temperature == 1.0 else fresh.div_(temperature)


def _accumulate(total: Tensor | None, grad: Tensor, hidden: Tensor) -> Tensor:
    """The weight gradient summed over chunks, grad^T @ hidden each, in float32 at least (bf16
    sums would drift): float32 in place (no chunk-sized temporary), bf16 one chunk's part at a
    time into a float32 total."""
    if total is None:
        part = grad.t() @ hidden
        return part if part.dtype == _compute_dtype(part.dtype) else part.float()
    if grad.dtype == total.dtype:
        return total.addmm_(grad.t(), hidden)
    return total.add_(grad.t() @ hidden)


def chunked_vocab_parallel_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(targets) [N] under softmax(hidden @ weight.T / temperature), and optionally the
    entropies (detached), from hidden states [N, H] and this rank's vocab shard of the output
    layer [V / tp, H] (module docstring). The gradient flows into hidden and weight; the
    hidden states' gradient is this rank's share (its vocab shard's): the caller reduces it
    over the TP group (megatron's copy_to / gather_from regions do). chunk: tokens per chunk
    (default chunk_tokens(V / tp))."""
    log_probs, entropy, _ = chunked_vocab_parallel_scores(
        hidden,
        weight,
        targets,
        group,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk=chunk,
    )
    return log_probs, entropy


def chunked_vocab_parallel_scores(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ids: Tensor | None = None,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """chunked_vocab_parallel_log_probs, and with `ids` [N, K] (token ids) also their
    log-probs [N, K] under the same distribution, detached, made in the same chunks and
    collectives (None without ids)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V / tp, H] expected, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    vocab_size = weight.shape[0] * _group_rank_and_size(group)[1]
    _check_targets(targets, hidden.shape[:1], vocab_size)
    if ids is not None:
        _check_targets(ids, (hidden.shape[0], ids.shape[-1]), vocab_size, "ids")
    chunk = chunk or chunk_tokens(weight.shape[0])
    return _ChunkedLogProbs.apply(
        hidden, weight, targets, group, temperature, with_entropy, chunk, ids
    )


def loss_path_extra_memory(
    hidden: Tensor, weight: Tensor, targets: Tensor, ids: Tensor | None = None
) -> float:
    """The chunked loss path's peak memory, forward and backward, beyond its inputs and the two
    gradients it returns, over the fp32 logits it never builds (tokens x V x 4 B); counted
    tensor by tensor on any device (utils/tensor_memory.py); with `ids`, scoring them too (the
    top-K gate's). What tools/bench_learner.py reports and tests/unit/test_vocab_parallel.py
    bounds."""
    from megatron_fr.utils.tensor_memory import LiveTensorBytes

    hidden, weight = (x.detach().requires_grad_(True) for x in (hidden, weight))
    with LiveTensorBytes() as memory:
        log_probs, _, _ = chunked_vocab_parallel_scores(hidden, weight, targets, ids=ids)
        log_probs.sum().backward()
    assert hidden.grad is not None and weight.grad is not None, "the backward just ran"
    returned = hidden.grad.nbytes + weight.grad.nbytes
    return (memory.peak - returned) / (targets.numel() * weight.shape[0] * 4)
