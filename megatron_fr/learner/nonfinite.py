"""Whether a step's loss or gradient is non-finite, decided once for every rank before the
optimizer runs.

Why before: megatron's optimizer checks for inf / nan only under fp16 loss scaling. In bf16 or
fp32 a NaN gradient goes through the clip (whose coefficient is then NaN too) into Adam, every
weight becomes NaN, every later step's gradient is NaN, and the engines that receive those
weights answer every request with an error ("probability tensor contains inf/nan"). A step
judged here is skipped whole instead: no optimizer step, no schedule step, nothing sent.

What is checked: this rank's loss values (the last pipeline stage holds them) and this rank's
whole gradient buffer. After the backward pass each rank's buffer holds its reduced shard and
its own unreduced contributions elsewhere, so a non-finite value in any rank's gradient, or a
sum that overflowed, shows in some rank's buffer; a MAX all-reduce makes it every rank's
answer, so all ranks skip or none does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def nonfinite_cause(per_micro: list[dict], module: torch.nn.Module) -> str | None:
    """ "loss" or "gradient" when some rank's is not finite (the loss named first), else None.
    A collective: every rank calls it after the backward pass of the same step."""
    device = next(module.parameters()).device
    loss = any(not torch.isfinite(micro["loss"]).all() for micro in per_micro)
    grads = (getattr(param, "main_grad", None) for param in module.parameters())
    gradient = any(grad is not None and not torch.isfinite(grad).all() for grad in grads)
    flags = torch.tensor([float(loss), float(gradient)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return "loss" if flags[0] else "gradient" if flags[1] else None
