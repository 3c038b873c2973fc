"""One optimizer step's figures, typed from the learner's reduction to the run's report.

    last pipeline stage: Reduced (the loss and the gate's figures, reduced over DP ranks)
        ─► one float64 tensor laid out by Reduced's fields ─► broadcast to the other stages
        ─► Reduced.unpack on every rank ─► StepMetrics (learner/trainer.py train_share)
        ─► the controller's skip count ─► RunReport.step ─► metrics.jsonl and the sinks

StepMetrics is a TypedDict: a plain dict at run time (what train_share has always returned and
its callers index), its keys and their types checked statically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch


@dataclass(frozen=True)
class Reduced:
    """What the last pipeline stage reduces and every stage receives. Its tensor is the
    scalars in field order, then each list field, one value per trajectory ([B] each)."""

    loss: float
    acceptance_rate: float
    clip_fraction: float
    sequence_kl_mean: float
    retained_tokens_mean: float
    """Tokens that carried gradient per trajectory, mean over the batch's trajectories."""
    admitted: list[bool]
    sequence_kl: list[float]
    retained_tokens: list[float]
    """Per trajectory: its tokens that carried gradient (0 where the gate held it out)."""

    @staticmethod
    def width(size: int) -> int:
        """The tensor's length for a batch of `size` trajectories."""
        return len(SCALARS) + len(PER_TRAJECTORY) * size

    @staticmethod
    def pack(values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tensor of every field's value: 0-d for a scalar, [B] for a list."""
        scalars = torch.stack([values[name].double() for name in SCALARS])
        return torch.cat([scalars, *(values[name].double() for name in PER_TRAJECTORY)])

    @staticmethod
    def unpack(values: torch.Tensor, size: int) -> Reduced:
        scalars = dict(zip(SCALARS, values[: len(SCALARS)].tolist(), strict=True))
        lists = dict(zip(PER_TRAJECTORY, values[len(SCALARS) :].split(size), strict=True))
        return Reduced(
            **scalars,
            admitted=[bool(a) for a in lists["admitted"].tolist()],
            sequence_kl=lists["sequence_kl"].tolist(),
            retained_tokens=lists["retained_tokens"].tolist(),
        )


SCALARS = tuple(f.name for f in dataclasses.fields(Reduced) if f.type == "float")
PER_TRAJECTORY = tuple(f.name for f in dataclasses.fields(Reduced) if f.name not in SCALARS)


class StepMetrics(TypedDict):
    loss: float
    acceptance_rate: float
    clip_fraction: float
    sequence_kl_mean: float
    admitted: list[bool]
    """Per trajectory, in batch order: whether the gate let it train."""
    sequence_kl: list[float]
    """Per trajectory, in batch order: the gate's KL."""
    retained_tokens_mean: float
    retained_tokens: list[float]
    """Per trajectory, in batch order: its tokens that carried gradient."""
    adam_step_min: float
    adam_step_max: float
    grad_norm: float
    """NaN when the step was skipped."""
    update_successful: float
    lr: float
    policy_tokens: float
    nonfinite: str | None
    """None, or "loss" / "gradient" when that was not finite and the step was skipped."""
    advantages: list[float]
    padding_fraction: float
    dp_imbalance: float
    step_skipped: NotRequired[float]
    """Set by the run's count of skipped steps (orchestrator/controller.py SkippedSteps)."""
    skipped_steps_total: NotRequired[int]
