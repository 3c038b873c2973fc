"""Hyperparameters of the policy losses: FlashREINFORCE's gate and filter, and the PPO-clip
family's clip range, aggregation and rollout correction (docs/algorithm.md)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from megatron_fr.config.base import StrictModel

MAX_GATE_TOP_K = 64
"""The largest K of the top-K gate: its trajectories carry K x TOP_K_ENTRY_BYTES = 512 bytes
per policy token at most."""
TOP_K_ENTRY_BYTES = 8
"""One top-K entry a trajectory carries per policy token: an int32 token id and the float32
log-prob the engine sampled it with."""


class FlashReinforceConfig(StrictModel):
    """The sequence-level trust region (the paper's Bernoulli-KL gate, or the optional top-K
    gate) and the optional negative-token filter."""

    delta: float = Field(default=3e-3, allow_inf_nan=True)
    """Gate threshold on the mean per-token Bernoulli KL of a trajectory; inf disables the gate.
    Paper settings: 3e-3 default, 1e-3 tool use and ALFWorld, 5e-3 R1-Distill at lag 4,
    1e-2 for the Qwen3-30B-A3B comparison."""
    negative_token_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """q: a failed trajectory keeps only its ceil(q * T) highest-entropy policy tokens (1 = off)."""
    gate_kl: Literal["bernoulli", "topk"] = "bernoulli"
    """The per-token KL the gate averages. bernoulli (the paper's): the Bernoulli proxy of the
    sampled token's probability. topk (optional, not the paper's; docs/algorithm.md): the KL
    between the engine's and the learner's distributions over the engine's top gate_top_k
    tokens plus one bucket for the rest of the vocabulary, which sees a shift of the mass
    among the likely tokens that the sampled token alone can miss."""
    gate_top_k: int = Field(default=8, ge=1, le=MAX_GATE_TOP_K)
    """K of the topk gate. The engines return the top-K log-probs of every generated token
    (SGLang's top_logprobs_num) and each trajectory carries them: K x 8 bytes per policy token
    (an int32 id and a float32 log-prob each; 64 bytes at K = 8, 512 at the bound K = 64),
    nothing for other tokens. Unused by the bernoulli gate."""

    @field_validator("delta")
    @classmethod
    def _delta_non_negative(cls, value: float) -> float:
        if math.isnan(value) or value < 0:
            raise ValueError(f"delta must be >= 0 (inf disables the gate), got {value}")
        return value


class PPOClipConfig(StrictModel):
    """The clipped-ratio loss of the PPO family (GRPO, Dr. GRPO, RLOO baselines); the ratio is
    taken against the behaviour log-probs the engine reported (algo/ppo.py)."""

    eps_low: float = Field(default=0.2, ge=0)
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: float = Field(default=0.2, ge=0)
    """Clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high > eps_low)."""
    aggregation: Literal["token_mean", "sequence_mean", "token_sum_norm"] | None = None
    """token_mean: every policy token of the batch weighs the same (DAPO, verl's token-mean);
    sequence_mean: each trajectory's token mean, then the mean over the batch (GRPO as
    published); token_sum_norm: token sums over one constant, no per-length weighting (Dr.
    GRPO, whose constant is its generation budget; here the batch's longest trajectory's
    policy tokens). None: the estimator's own (LearnerConfig resolves it)."""
    correction: Literal["none", "token_mask", "sequence_mask_sum", "sequence_mask_mean"] = "none"
    """Asynchronous rollout correction: drop tokens (token_mask, IcePop) or whole trajectories
    (by the sum or mean of their log-ratio) whose ratio pi / mu lies outside
    [correction_low, correction_high]."""
    correction_low: float = Field(default=0.5, ge=0)
    """Lower end of the ratio pi / mu a token or trajectory keeps under `correction`."""
    correction_high: float = Field(default=2.0, gt=0)
    """Upper end of the ratio pi / mu a token or trajectory keeps under `correction`."""

    @model_validator(mode="after")
    def _interval(self) -> PPOClipConfig:
        if self.correction_low > self.correction_high:
            raise ValueError(
                f"correction_low ({self.correction_low}) must be <= correction_high "
                f"({self.correction_high})"
            )
        return self
