"""The learner's optimisation settings: loss, estimator, optimizer, schedule, micro-batching,
and the one rule for how long a trajectory a micro-batch can hold (longest_row), which the
learner's packing, the layout planner and `train --check` all apply."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_fr.config.algo import FlashReinforceConfig, PPOClipConfig
from megatron_fr.config.base import StrictModel

LOSS_CHUNK_BYTES = 128 * 2**20
"""fp32 logits per chunk of the learner's loss path (parallel/vocab_parallel.py): 220 tokens at
Qwen3's vocabulary (151,936, TP1), a whole micro-batch for a small one. The layout planner
counts the loss path's memory with it."""

ESTIMATOR_LOSSES: dict[str, tuple[str, str | None]] = {
    "flash_reinforce": ("flash_reinforce", None),
    "grpo": ("ppo_clip", "sequence_mean"),
    "dr_grpo": ("ppo_clip", "token_sum_norm"),
    "rloo": ("ppo_clip", "token_mean"),
    "reinforce_baseline": ("ppo_clip", "token_mean"),
}
"""Each estimator with the loss it is known by: (policy loss, PPO-clip aggregation)."""


class LearnerConfig(StrictModel):
    estimator: Literal["flash_reinforce", "grpo", "dr_grpo", "rloo", "reinforce_baseline"] = (
        "flash_reinforce"
    )
    """Advantage estimator (algo/advantages.py): flash_reinforce (A_i = R_i - mean R over the
    batch), or a group baseline (grpo, dr_grpo, rloo, reinforce_baseline) which needs several
    rollouts per prompt (buffer.group_size)."""
    policy_loss: Literal["flash_reinforce", "ppo_clip"] | None = None
    """flash_reinforce: the gated, unclipped sample-mean loss; ppo_clip: the clipped ratio of
    the PPO family. None: the estimator's own (ESTIMATOR_LOSSES), written back here so the
    run's config.yaml shows the pairing."""
    flash_reinforce: FlashReinforceConfig = FlashReinforceConfig()
    """The trust-region gate and negative-token filter of the flash_reinforce loss."""
    ppo_clip: PPOClipConfig = PPOClipConfig()
    """Clip range, aggregation (None: the estimator's own) and correction of ppo_clip."""
    moe_aux_loss_coeff: float | None = Field(default=0.0, ge=0)
    """Router load-balancing loss during RL; None keeps the checkpoint's router_aux_loss_coef.
    Off by default: RL fine-tunes a balanced pretrained router, and the extra loss is not part
    of the policy-gradient objective."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation, megatron's own (TransformerConfig.recompute_*): none keeps
    every layer's activations for the backward pass; selective keeps the attention's and
    re-runs each layer's MoE block (dense models: its MLP) in the backward (granularity
    "selective", module moe / mlp); full keeps only each layer's input and re-runs the whole
    layer (granularity "full", method "uniform", one layer per unit). The step is the same
    either way; routing replay routes the recomputation as the engine did. The layout
    planner and `train --check` judge memory with this setting."""
    routing_replay: bool = False
    """MoE routing replay (R3): the learner's routers use the experts the engine routed each
    position to (carried by the trajectories) instead of their own top-k, so expert choices
    flipped by bf16 kernels, expert-parallel layouts or weights a few versions apart do not
    inflate the train-inference mismatch the gate measures. Needs a MoE model and engines that
    return routed experts (SGLang: --enable-return-routed-experts); refused otherwise."""
    micro_batch_tokens: int = Field(default=4096, ge=1)
    """Tokens of one micro-batch on each GPU of a data-parallel replica's context-parallel
    group: a micro-batch (rows x width, before the CP split) holds micro_batch_tokens x CP, so
    its longest row does too (longest_row: less the CP and SP padding, plus the last token,
    which is only a target)."""
    pack_sequences: bool = True
    """Pack several trajectories per micro-batch row (THD / cu_seqlens on GPU, a
    block-diagonal causal mask on CPU); False: one right-padded trajectory per row."""
    params_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """The learner's parameter and compute dtype (the optimizer keeps float32 master weights)."""
    lr: float = Field(default=1e-6, gt=0)
    """Peak learning rate of the distributed Adam optimizer."""
    min_lr: float = Field(default=0.0, ge=0)
    """The rate a linear or cosine decay ends at (at most lr)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to lr."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """How the rate goes from lr toward min_lr after the warmup."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (AdamW)."""
    clip_grad: float = Field(default=1.0, ge=0)
    """Global gradient-norm clip (0 disables)."""
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam's first-moment decay."""
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    """Adam's second-moment decay."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """Adam's epsilon (added to the second moment's square root)."""
    max_nonfinite_steps: int = Field(default=5, ge=1)
    """A step whose loss or gradient is not finite is skipped (no update, nothing sent to the
    engines, counted as skipped_steps_total); this many in a row end the run, naming it."""

    @model_validator(mode="after")
    def _schedule_bounds(self) -> LearnerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr:g}) must not exceed lr ({self.lr:g})")
        return self

    @property
    def top_logprobs(self) -> int:
        """The top-K log-probs every policy token of a trajectory must carry for this learner's
        loss: the topk gate's K (flash_reinforce.gate_top_k), else 0 (none asked for)."""
        gate = self.flash_reinforce
        topk = self.policy_loss == "flash_reinforce" and gate.gate_kl == "topk"
        return gate.gate_top_k if topk else 0

    @model_validator(mode="before")
    @classmethod
    def _pair_estimator_and_loss(cls, data: Any) -> Any:
        """Fill policy_loss and ppo_clip.aggregation left unset with the estimator's own."""
        if not isinstance(data, dict) or data.get("estimator", "flash_reinforce") not in (
            ESTIMATOR_LOSSES
        ):
            return data  # field validation reports what is wrong
        loss, aggregation = ESTIMATOR_LOSSES[data.get("estimator", "flash_reinforce")]
        data = {**data, "policy_loss": data.get("policy_loss") or loss}
        ppo = data.get("ppo_clip", {})
        ppo = ppo.model_dump() if isinstance(ppo, PPOClipConfig) else dict(ppo)
        if ppo.get("aggregation") is None:
            ppo["aggregation"] = aggregation or "token_mean"
        return {**data, "ppo_clip": ppo}


def width_multiple(context: int, sequence_parallel_size: int) -> int:
    """What every micro-batch row's width divides by: megatron's zigzag CP split cuts each
    sequence into 2 x CP chunks, and sequence parallelism splits the row again over TP."""
    return (2 * context if context > 1 else 1) * sequence_parallel_size


def longest_row(micro_batch_tokens: int, context: int, sequence_parallel_size: int = 1) -> int:
    """The longest trajectory (tokens) a micro-batch can hold: its row is at most
    micro_batch_tokens x CP tokens wide, rounded down to the width multiple; a trajectory of
    n tokens feeds n - 1 of them to the model (the last is only a target), padded up to a
    multiple of 2 x CP under CP (which the width multiple is)."""
    multiple = width_multiple(context, sequence_parallel_size)
    return micro_batch_tokens * context // multiple * multiple + 1


def micro_batch_tokens_for(row: int, context: int, sequence_parallel_size: int = 1) -> int:
    """The least micro_batch_tokens whose micro-batch holds trajectories of `row` tokens."""
    multiple = width_multiple(context, sequence_parallel_size)
    width = math.ceil((row - 1) / multiple) * multiple
    return math.ceil(width / context)
