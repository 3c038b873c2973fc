"""The precision every policy loss computes in: float32 at least, whatever its inputs'.

A bfloat16 model scores its tokens in bfloat16 (8 bits of mantissa: log-probs near -0.01 are
off by ~1e-4, an importance ratio exp(pi - mu) by as much, and a gate threshold of 3e-3 sits
inside that noise). The paper's reference loss casts its inputs to float32 first; so do ours,
the gradient flowing back through the cast to the model's dtype. float64 inputs (the tests'
references) keep float64.
"""

from __future__ import annotations

import torch
from torch import Tensor


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or `dtype` where it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def in_loss_dtype(tensor: Tensor) -> Tensor:
    """`tensor` cast to loss_dtype (itself when it already is; differentiable)."""
    return tensor.to(loss_dtype(tensor.dtype))
