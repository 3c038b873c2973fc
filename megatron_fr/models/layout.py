"""The divisibility rules a model puts on a parallel layout.

megatron asserts them deep inside model build, with messages that name neither the model nor
the setting; checked here first, each refusal says which size fails which dimension. The module
imports no torch, so the layout planner (launch/plan.py) applies the same rules on a login node
that models/gpt.py applies when it builds.
"""

from __future__ import annotations

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.models.hf_config import HFModelSpec


class LayoutError(ValueError):
    """A layout megatron (or this project's learner) cannot run; the message says why."""


def check_model_layout(spec: HFModelSpec, parallel: ParallelConfig) -> None:
    """Raise LayoutError if megatron cannot shard `spec` as `parallel` asks."""
    tp, groups = parallel.tensor, spec.num_key_value_heads
    if groups % tp:
        raise LayoutError(
            f"TP {tp} does not divide the {groups} query groups (num_key_value_heads): "
            f"TP shards whole groups, so TP must be one of {divisors(groups)}"
        )
    if spec.vocab_size % tp:
        raise LayoutError(f"TP {tp} does not divide vocab_size {spec.vocab_size}")
    if spec.num_layers % parallel.pipeline:
        raise LayoutError(f"PP {parallel.pipeline} does not divide the {spec.num_layers} layers")
    if not spec.is_moe:
        if parallel.expert > 1:
            raise LayoutError(f"EP {parallel.expert} set for a dense model (no experts)")
        if spec.intermediate_size % tp:
            raise LayoutError(f"TP {tp} does not divide intermediate_size {spec.intermediate_size}")
        return
    if spec.num_experts % parallel.expert:
        raise LayoutError(f"EP {parallel.expert} does not divide the {spec.num_experts} experts")
    etp = parallel.effective_expert_tensor
    if spec.moe_intermediate_size % etp:
        raise LayoutError(
            f"ETP {etp} does not divide moe_intermediate_size {spec.moe_intermediate_size}"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
