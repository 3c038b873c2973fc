"""Input validation shared by every loss and estimator in megatron_fr.algo.

Each check raises ValueError naming the argument and the problem, so bad data from a rollout
or a packing bug is reported where it enters the loss instead of surfacing as a NaN later.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def check_action_mask(action_mask: Tensor, *, require_tokens: bool = True) -> None:
    """A bool [B, T] mask; with require_tokens, every row holds at least one policy token."""
    if action_mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be torch.bool, got {action_mask.dtype}")
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be [B, T], got shape {tuple(action_mask.shape)}")
    if action_mask.shape[0] == 0:
        raise ValueError("the batch is empty (B = 0)")
    if require_tokens:
        empty = (~action_mask.any(dim=1)).nonzero().flatten()
        if empty.numel():
            raise ValueError(
                f"trajectory {empty[:8].tolist()} has no policy tokens (empty trajectory); "
                "every row needs at least one action_mask=True token"
            )


def check_same_shape(reference_name: str, reference: Tensor, **tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(reference.shape)} "
                f"(the shape of {reference_name})"
            )


def check_float(**tensors: Tensor) -> None:
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def check_same_dtype(**tensors: Tensor) -> None:
    dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtype mismatch: {dtypes}")


def check_log_probs(name: str, log_probs: Tensor, action_mask: Tensor) -> None:
    """Finite and <= 0 on policy tokens (values elsewhere are ignored, e.g. padding)."""
    values = log_probs.detach()[action_mask]
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} has non-finite values on policy tokens")
    if (values > 0).any():
        raise ValueError(
            f"{name} has positive values on policy tokens (max {values.max().item():.3g}); "
            "log-probabilities must be <= 0"
        )


def check_rewards(rewards: Tensor, batch_size: int | None = None, name: str = "rewards") -> None:
    """Finite float per-trajectory values of shape [B] (rewards, or advantages via `name`)."""
    if rewards.dim() != 1:
        raise ValueError(f"{name} must be [B], got shape {tuple(rewards.shape)}")
    if batch_size is not None and rewards.shape[0] != batch_size:
        raise ValueError(f"{name} has {rewards.shape[0]} entries, expected B = {batch_size}")
    if not rewards.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {rewards.dtype}")
    if not torch.isfinite(rewards).all():
        bad = (~torch.isfinite(rewards)).nonzero().flatten()[:8].tolist()
        raise ValueError(f"{name} are non-finite at {bad}")


def check_policy_log_probs(action_mask: Tensor, **log_probs: Tensor) -> None:
    """The common contract of every policy loss: a bool [B, T] mask with a policy token per
    row, and same-shape, same-dtype float log-prob tensors, finite and <= 0 on policy tokens."""
    check_action_mask(action_mask)
    check_float(**log_probs)
    check_same_shape("action_mask", action_mask, **log_probs)
    check_same_dtype(**log_probs)
    for name, tensor in log_probs.items():
        check_log_probs(name, tensor, action_mask)


def check_non_negative(**values: float) -> None:
    """Scalar hyperparameters that must be >= 0 (inf allowed, NaN refused)."""
    for name, value in values.items():
        if math.isnan(value) or value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def check_segment_ids(segment_ids: Tensor, policy: Tensor, num_trajectories: int) -> None:
    """Every policy token's segment id is a trajectory of the batch, in [0, B)."""
    if segment_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"segment_ids must be integer trajectory ids, got {segment_ids.dtype}")
    used = segment_ids[policy]
    if used.numel() and (used.min() < 0 or used.max() >= num_trajectories):
        raise ValueError(
            f"segment_ids of policy tokens must be trajectory ids in [0, {num_trajectories}); "
            f"got [{used.min().item()}, {used.max().item()}]"
        )
