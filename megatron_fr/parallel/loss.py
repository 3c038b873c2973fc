"""The policy losses as the learner calls them: one micro-batch on one rank.

Inputs are this rank's view of a micro-batch: the log-probs pi of its target tokens (and
their entropies), a context-parallel slice of each row, rows that may pack several
trajectories. Every token carries the global id of its trajectory (segment_ids, -1 for
padding), so per-trajectory sums need no offsets bookkeeping after packing or CP slicing.

Order of operations (docs/algorithm.md, section 5):
  1. log-probs (and entropies when q < 1) from the vocab shard, reduced over the TP group,
     before the loss (the model's output, models/token_scores.py, or vocab_parallel.py's
     functions on logits);
  2. per-trajectory KL sums and token counts, summed over the CP group, then the gate, so
     every CP rank (and every TP rank) reaches the same m_i (the per-token KL is the
     Bernoulli proxy, or with gate_kl = topk the top-K KL from the engine's top-K log-probs
     and the learner's of the same ids, scored in step 1 with the same reductions);
  3. the negative-token filter on whole trajectories (gathered over CP);
  4. this micro-batch's share of L, divided by the GLOBAL number of trajectories B, so that
     the sum over micro-batches and data-parallel ranks is exactly L.
Advantages come from the whole batch (GlobalBatch), computed before any split.
Every TP rank returns the same loss value; megatron's reductions must not average it.
The PPO-clip loss (ppo_clip_scored_loss) takes the same inputs and the same route: its
per-trajectory sums (sequence corrections, the diagnostic KL) are reduced over the CP group,
its normalisers come from the whole batch (algo/ppo.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fr.algo import checks
from megatron_fr.algo.flash_reinforce import (
    GateResult,
    gate_metrics,
    negative_token_keep_mask,
    segment_policy_loss,
    sequence_gate,
    topk_kl,
    trust_region_gate,
)
from megatron_fr.algo.ppo import ppo_clip_loss
from megatron_fr.algo.precision import in_loss_dtype, loss_dtype
from megatron_fr.config.algo import FlashReinforceConfig, PPOClipConfig
from megatron_fr.parallel.vocab_parallel import vocab_parallel_log_probs

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def _tensors_to(batch: DataclassInstance, device: torch.device | str) -> dict[str, Any]:
    """A batch's fields with every tensor moved to `device` (None stays None): the keyword
    arguments of the same batch there."""
    values = {field.name: getattr(batch, field.name) for field in dataclasses.fields(batch)}
    return {name: None if t is None else t.to(device) for name, t in values.items()}


@dataclass(frozen=True)
class LossBatch:
    """This rank's slice of one micro-batch, all [rows, S_local] (CP-sliced when CP > 1)."""

    target_ids: Tensor
    """Token whose log-prob each position scores (the next token); 0 on padding."""
    behavior_log_probs: Tensor
    """mu: the inference engine's log-prob of each target token, as it sampled it."""
    action_mask: Tensor
    """True on policy tokens (not prompt, observation or padding)."""
    segment_ids: Tensor
    """Global index (0..B-1) of the trajectory each token belongs to; -1 for padding."""
    positions: Tensor
    """Position of each token within its own trajectory (packed rows restart at 0): orders
    tokens for the entropy tie-break."""
    topk_ids: Tensor | None = None
    """[rows, S_local, K] the engine's K most likely tokens of each target's distribution (the
    top-K gate's; 0 off policy tokens); None for the Bernoulli gate."""
    topk_log_probs: Tensor | None = None
    """[rows, S_local, K] their log-probs as the engine reported them (0 off policy tokens)."""

    def to(self, device: torch.device | str) -> LossBatch:
        """The same slice on `device` (micro-batches are built on the CPU)."""
        return LossBatch(**_tensors_to(self, device))


@dataclass(frozen=True)
class GlobalBatch:
    """Per-trajectory quantities of the whole batch (all DP ranks), computed once per step."""

    advantages: Tensor
    """A_i [B] (for FlashREINFORCE: R_i - mean R over the whole batch)."""
    failures: Tensor | None = None
    """[B] bool, trajectories labelled failed (only needed when q < 1)."""
    token_counts: Tensor | None = None
    """[B] policy tokens of each trajectory (the PPO-clip loss's normalisers need them)."""

    @property
    def num_trajectories(self) -> int:
        return self.advantages.numel()

    def to(self, device: torch.device | str) -> GlobalBatch:
        """The same batch on `device` (the learner builds it on the CPU; the loss runs where
        the logits are)."""
        return GlobalBatch(**_tensors_to(self, device))


def sum_over(group: dist.ProcessGroup | None) -> Callable[[Tensor], Tensor]:
    """The per-segment sums' reduction over `group` (the CP group: each rank holds a slice of
    every trajectory); the identity without one."""

    def reduce(partial: Tensor) -> Tensor:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(partial, group=group)
        return partial

    return reduce


def _gather_along_sequence(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _keep_mask(
    entropies: Tensor,
    batch: LossBatch,
    failures: Tensor,
    fraction: float,
    cp_group: dist.ProcessGroup | None,
) -> Tensor:
    """Negative-token filter on whole trajectories: gather the CP slices, decide, slice back."""
    whole_entropies, mask, segment_ids, positions = (
        _gather_along_sequence(t, cp_group)
        for t in (entropies, batch.action_mask, batch.segment_ids, batch.positions)
    )
    keep = negative_token_keep_mask(
        whole_entropies, mask, segment_ids, positions, failures=failures, fraction=fraction
    )
    width = batch.action_mask.shape[-1]
    rank = 0 if cp_group is None else dist.get_rank(cp_group)
    return keep[..., rank * width : (rank + 1) * width]


_SKIP_INPUT_CHECKS = contextvars.ContextVar("skip_loss_input_checks", default=False)


@contextlib.contextmanager
def skip_input_checks() -> Iterator[None]:
    """Leave check_loss_inputs' value checks out within the block: for a rehearsal under
    fake tensors (launch/rehearsal.py), whose inputs have shapes and no values to check."""
    token = _SKIP_INPUT_CHECKS.set(True)
    try:
        yield
    finally:
        _SKIP_INPUT_CHECKS.reset(token)


def check_loss_inputs(batch: LossBatch, global_batch: GlobalBatch) -> None:
    checks.check_same_shape(
        "target_ids",
        batch.target_ids,
        behavior_log_probs=batch.behavior_log_probs,
        action_mask=batch.action_mask,
        segment_ids=batch.segment_ids,
        positions=batch.positions,
    )
    if batch.topk_ids is None or batch.topk_log_probs is None:
        if batch.topk_ids is not None or batch.topk_log_probs is not None:
            raise ValueError("topk_ids and topk_log_probs come together (the top-K gate's input)")
    else:
        checks.check_same_shape("topk_ids", batch.topk_ids, topk_log_probs=batch.topk_log_probs)
        if batch.topk_ids.shape[:-1] != batch.target_ids.shape:
            raise ValueError(
                f"topk_ids has shape {tuple(batch.topk_ids.shape)}, expected "
                f"{tuple(batch.target_ids.shape)} + [K]"
            )
    if _SKIP_INPUT_CHECKS.get():
        return
    checks.check_action_mask(batch.action_mask, require_tokens=False)
    checks.check_log_probs("behavior_log_probs", batch.behavior_log_probs, batch.action_mask)
    checks.check_rewards(global_batch.advantages, name="advantages")
    checks.check_segment_ids(batch.segment_ids, batch.action_mask, global_batch.num_trajectories)


def flash_reinforce_scored_loss(
    log_probs: Tensor,
    entropies: Tensor | None,
    batch: LossBatch,
    global_batch: GlobalBatch,
    config: FlashReinforceConfig,
    *,
    cp_group: dist.ProcessGroup | None = None,
    topk_log_probs: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's contribution to L and its metrics (per-trajectory ones are [B]).

    log_probs: [rows, S_local], pi of the target tokens (carries the gradient); entropies:
    their entropies, needed when negative_token_fraction < 1; topk_log_probs: [rows, S_local,
    K], pi of batch.topk_ids, needed by the top-K gate (config.gate_kl = topk). The
    contributions of all micro-batches and data-parallel ranks add up to the single-process
    flash_reinforce_loss of the whole batch, and so do their gradients.
    """
    check_loss_inputs(batch, global_batch)
    checks.check_non_negative(delta=config.delta)
    fraction = config.negative_token_fraction
    if fraction < 1.0 and (global_batch.failures is None or entropies is None):
        raise ValueError("negative_token_fraction < 1 needs GlobalBatch.failures and entropies")
    # the engine's log-probs, never rounded to the model's bf16 (algo/precision.py)
    behavior = batch.behavior_log_probs.to(loss_dtype(log_probs.dtype))
    gate = _gate(log_probs, behavior, batch, global_batch, config, cp_group, topk_log_probs)
    keep = batch.action_mask & (batch.segment_ids >= 0)
    if fraction < 1.0:
        assert entropies is not None and global_batch.failures is not None  # checked above
        keep = _keep_mask(entropies, batch, global_batch.failures, fraction, cp_group)
    loss, ratios, contributing = segment_policy_loss(
        log_probs, behavior, gate, global_batch.advantages, keep, batch.segment_ids
    )
    metrics = gate_metrics(gate, ratios, contributing, batch.segment_ids)
    metrics["present"] = gate.present
    return loss, metrics


def _gate(
    log_probs: Tensor,
    behavior: Tensor,
    batch: LossBatch,
    global_batch: GlobalBatch,
    config: FlashReinforceConfig,
    cp_group: dist.ProcessGroup | None,
    topk_log_probs: Tensor | None,
) -> GateResult:
    """The configured gate: the Bernoulli proxy of the target's probability, or the top-K KL
    of the engine's and the learner's log-probs of the engine's top-K ids."""
    where = (batch.action_mask, batch.segment_ids, global_batch.num_trajectories, config.delta)
    if config.gate_kl == "bernoulli":
        return trust_region_gate(log_probs, behavior, *where, reduce_segments=sum_over(cp_group))
    if batch.topk_log_probs is None or topk_log_probs is None:
        raise ValueError(
            "gate_kl topk needs the engine's top-K log-probs (LossBatch.topk_log_probs) and the "
            "learner's of the same ids (topk_log_probs)"
        )
    checks.check_same_shape(
        "LossBatch.topk_log_probs", batch.topk_log_probs, topk_log_probs=topk_log_probs
    )
    token_kl = topk_kl(in_loss_dtype(batch.topk_log_probs), in_loss_dtype(topk_log_probs.detach()))
    return sequence_gate(token_kl, *where, reduce_segments=sum_over(cp_group))


def ppo_clip_scored_loss(
    log_probs: Tensor,
    batch: LossBatch,
    global_batch: GlobalBatch,
    config: PPOClipConfig,
    *,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the batch's PPO-clip loss (algo/ppo.py), and its metrics;
    log_probs as for flash_reinforce_scored_loss."""
    check_loss_inputs(batch, global_batch)
    if global_batch.token_counts is None:
        raise ValueError("the PPO-clip loss needs GlobalBatch.token_counts")
    return ppo_clip_loss(
        in_loss_dtype(log_probs),
        batch.behavior_log_probs.to(loss_dtype(log_probs.dtype)),
        global_batch.advantages,
        batch.action_mask,
        batch.segment_ids,
        global_batch.token_counts,
        config,
        reduce_segments=sum_over(cp_group),
    )


def flash_reinforce_parallel_loss(
    logits: Tensor,
    batch: LossBatch,
    global_batch: GlobalBatch,
    config: FlashReinforceConfig,
    *,
    tp_group: dist.ProcessGroup | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """flash_reinforce_scored_loss for a caller that holds logits: [rows, S_local, V / tp],
    this rank's vocab shard, scored with vocab_parallel_log_probs; metrics["log_probs"] are
    the scores. (The learner scores from the hidden states instead: models/token_scores.py.)"""
    log_probs, entropies = vocab_parallel_log_probs(
        logits, batch.target_ids, tp_group, with_entropy=config.negative_token_fraction < 1
    )
    loss, metrics = flash_reinforce_scored_loss(
        log_probs, entropies, batch, global_batch, config, cp_group=cp_group
    )
    return loss, {**metrics, "log_probs": log_probs.detach()}


def agreed_admission(
    per_micro_batch: list[dict[str, Tensor]], group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor]:
    """(admitted [B], present [B]) over all micro-batches and the ranks of ``group``.

    Pass megatron's data-parallel group with context parallelism: each trajectory lives in
    exactly one micro-batch of one DP rank (and all its CP peers), so the union is the batch.
    """
    admitted = torch.stack([m["admitted"] for m in per_micro_batch]).any(0).to(torch.int64)
    present = torch.stack([m["present"] for m in per_micro_batch]).any(0).to(torch.int64)
    both = torch.stack([admitted, present])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[0].bool(), both[1].bool()
