"""The policy loss a learner trains with, chosen once from its config (learner.policy_loss), as
the advantage estimator is: FlashREINFORCE's gated importance-weighted loss, or PPO-clip for the
group baselines. Each is one micro-batch's share of the batch loss, computed before the parallel
reduction (parallel/loss.py), with the metrics the step reduces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from megatron_fr.config import LearnerConfig
from megatron_fr.config.algo import FlashReinforceConfig, PPOClipConfig
from megatron_fr.parallel.loss import (
    GlobalBatch,
    LossBatch,
    flash_reinforce_scored_loss,
    ppo_clip_scored_loss,
)


class PolicyLoss(Protocol):
    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads each target token's entropy (the scores carry them then)."""
        ...

    def __call__(
        self,
        log_probs: Tensor,
        entropies: Tensor | None,
        batch: LossBatch,
        global_batch: GlobalBatch,
        cp_group: dist.ProcessGroup | None,
        topk_log_probs: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class FlashReinforceLoss:
    config: FlashReinforceConfig

    @property
    def needs_entropy(self) -> bool:
        """The negative-token filter ranks a failed trajectory's tokens by their entropy."""
        return self.config.negative_token_fraction < 1

    def __call__(
        self,
        log_probs: Tensor,
        entropies: Tensor | None,
        batch: LossBatch,
        global_batch: GlobalBatch,
        cp_group: dist.ProcessGroup | None,
        topk_log_probs: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return flash_reinforce_scored_loss(
            log_probs,
            entropies,
            batch,
            global_batch,
            self.config,
            cp_group=cp_group,
            topk_log_probs=topk_log_probs,
        )


@dataclass(frozen=True)
class PPOClipLoss:
    config: PPOClipConfig
    needs_entropy: bool = False

    def __call__(
        self,
        log_probs: Tensor,
        entropies: Tensor | None,
        batch: LossBatch,
        global_batch: GlobalBatch,
        cp_group: dist.ProcessGroup | None,
        topk_log_probs: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return ppo_clip_scored_loss(log_probs, batch, global_batch, self.config, cp_group=cp_group)


def policy_loss(config: LearnerConfig) -> PolicyLoss:
    """The loss learner.policy_loss names (its validator fills it from the estimator)."""
    if config.policy_loss == "ppo_clip":
        return PPOClipLoss(config.ppo_clip)
    return FlashReinforceLoss(config.flash_reinforce)
