"""Hyperparameters of the FlashREINFORCE loss (ALGORITHM.md)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator


class FlashReinforceConfig(BaseModel):
    """The sequence-level Bernoulli-KL trust region and the optional negative-token filter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delta: float = 3e-3
    """Gate threshold on the mean per-token Bernoulli KL of a trajectory; inf disables the gate.
    Paper settings: 3e-3 default, 1e-3 tool use and ALFWorld, 5e-3 R1-Distill at lag 4,
    1e-2 for the Qwen3-30B-A3B comparison."""
    negative_token_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """q: a failed trajectory keeps only its ceil(q * T) highest-entropy policy tokens (1 = off)."""

    @field_validator("delta")
    @classmethod
    def _delta_non_negative(cls, value: float) -> float:
        if math.isnan(value) or value < 0:
            raise ValueError(f"delta must be >= 0 (inf disables the gate), got {value}")
        return value
