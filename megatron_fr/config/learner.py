"""The learner's optimisation settings: loss, estimator, optimizer, schedule, micro-batching."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from megatron_fr.config.algo import FlashReinforceConfig


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: str = "flash_reinforce"
    """Advantage estimator (algo.advantages registry): flash_reinforce (A_i = R_i - mean R over
    the batch), or a group baseline (grpo, dr_grpo, rloo, reinforce_baseline) which needs
    several rollouts per prompt (RunConfig.rollout.group_size)."""
    flash_reinforce: FlashReinforceConfig = FlashReinforceConfig()
    """The trust-region gate and negative-token filter (used by every estimator)."""
    moe_aux_loss_coeff: float | None = Field(default=0.0, ge=0)
    """Router load-balancing loss during RL; None keeps the checkpoint's router_aux_loss_coef.
    Off by default: RL fine-tunes a balanced pretrained router, and the extra loss is not part
    of the policy-gradient objective."""
    micro_batch_tokens: int = Field(default=4096, ge=1)
    """Per-rank token budget of one micro-batch (rows x padded width)."""
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    lr: float = Field(default=1e-6, gt=0)
    min_lr: float = Field(default=0.0, ge=0)
    lr_warmup_steps: int = Field(default=0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = Field(default=0.0, ge=0)
    clip_grad: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip (0 disables)."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_eps: float = Field(default=1e-8, gt=0)
