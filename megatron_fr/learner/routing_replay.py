"""Routing replay (R3): the learner's MoE routers take the experts the inference engine chose.

The learner and the engines route tokens independently, and small numeric differences (bf16
kernels, expert-parallel layouts, weights a few versions apart) flip top-k choices, which
inflates the train-inference mismatch the trust-region gate measures. With
learner.routing_replay the trajectory's routed experts (engine/routing.py: one record per
position the learner feeds, as the engine reported it) drive megatron's own router replay
(megatron/core/transformer/moe/router_replay.py, TransformerConfig.moe_enable_routing_replay):

    micro-batching ─► MicroBatch.routing [rows, width, layers, top_k] (padding_routing on
                      padding positions: they are out of the loss and only take expert slots)
    forward_step ───► RoutingReplay.load: each router of this stage gets its layer's ids for
                      the tokens IT sees (megatron's [sequence, batch] order, this TP rank's
                      slice of the sequence under sequence parallelism); action REPLAY_FORWARD
    backward of that micro-batch starts (a pre-hook on its output's autograd node)
                 ───► action REPLAY_BACKWARD: activation recomputation pops each layer's ids
                      first in, first out, which is the order the pipeline schedules run the
                      backward passes in, so a stage that ran later forwards meanwhile still
                      recomputes every micro-batch with its own routing
    schedule done ──► clear (no ids outlive the step)

Pipeline stages: a stage has only its own layers' routers and is given only its own layers'
routing columns (stage_layers); router.layer_number is the global layer, so each router reads
column layer_number - 1 - (the stage's first layer). What replay fixes is WHICH experts a
token goes to; their weights are still the learner's own (its router's scores at those
experts), so the router keeps its gradient. megatron's fused (TE) router ignores replay: the
model is built with moe_router_fusion off (its default) and moe_enable_routing_replay on.
Context parallelism (not in the learner yet) will need the same slicing as its tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.models.hf_config import HFModelSpec

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule


def padding_routing(shape: tuple[int, int], top_k: int, num_experts: int) -> torch.Tensor:
    """[rows, width, 1, top_k] ids for positions no trajectory fills: token n takes experts
    n*k .. n*k + k - 1 (mod E), distinct within a token and spread evenly over the experts
    (so over the expert-parallel ranks)."""
    count = shape[0] * shape[1]
    ids = torch.arange(count * top_k).view(*shape, 1, top_k) % num_experts
    return ids.to(torch.int16 if num_experts > 256 else torch.uint8)


def check_routed_batch(batch: list[Trajectory], spec: HFModelSpec) -> None:
    """Every trajectory carries routed experts of the model's layout (layers, top-k, experts);
    ValueError naming the first that does not."""
    expected = (spec.num_layers, spec.num_experts_per_tok, spec.num_experts)
    for t in batch:
        if t.routed_experts is None:
            raise ValueError(
                f"learner.routing_replay is on but trajectory {t.prompt_id!r} carries no routed "
                "experts: the rollout client must ask for them (RolloutClientConfig."
                "routed_experts) and SGLang must run with --enable-return-routed-experts"
            )
        _, layers, top_k = t.routed_experts.experts.shape
        if (layers, top_k, t.routed_experts.num_experts) != expected:
            raise ValueError(
                f"trajectory {t.prompt_id!r}: routed experts of {layers} layers x top-{top_k} of "
                f"{t.routed_experts.num_experts} experts; the model has {expected[0]} layers x "
                f"top-{expected[1]} of {expected[2]}"
            )


class RoutingReplay:
    """Drives the RouterReplay of this rank's MoE layers through one forward(-backward)."""

    def __init__(self, module: MegatronModule, spec: HFModelSpec, tp_group: ProcessGroup):
        from megatron.core.transformer.moe.router import TopKRouter

        self.spec = spec
        self.tp_group = tp_group
        """Under sequence parallelism each TP rank routes its own slice of the sequence."""
        self.routers = sorted(
            (m for m in module.modules() if isinstance(m, TopKRouter) and m.router_replay),
            key=lambda router: router.layer_number,
        )
        if not self.routers:
            raise ValueError(
                "routing replay: this model stage has no MoE router with replay enabled (build "
                "it with routing_replay=True)"
            )
        self.sequence_parallel = module.config.sequence_parallel

    @property
    def stage_layers(self) -> slice:
        """The layers of this pipeline stage (0-based, global): the routing columns its
        micro-batches carry (a stage is sent its own layers' routing only)."""
        return slice(self.routers[0].layer_number - 1, self.routers[-1].layer_number)

    def check(self, batch: list[Trajectory]) -> None:
        check_routed_batch(batch, self.spec)

    def load(self, routing: torch.Tensor) -> None:
        """Before a micro-batch's forward: its routing [rows, width, stage layers, top_k]
        (the columns of stage_layers)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        tokens = routing.transpose(0, 1)  # megatron's [sequence, batch] token order
        if self.sequence_parallel:  # each TP rank routes its own slice of the sequence
            chunk = tokens.shape[0] // self.tp_group.size()
            start = self.tp_group.rank() * chunk
            tokens = tokens[start : start + chunk]
        first = self.stage_layers.start
        for router in self.routers:
            ids = tokens[:, :, router.layer_number - 1 - first].reshape(-1, tokens.shape[-1])
            ids = ids.long()
            router.router_replay.set_target_indices(ids)
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def replay_in_backward(self, output: torch.Tensor) -> None:
        """Switch to REPLAY_BACKWARD when the backward pass of `output` (the micro-batch's
        model output) starts, before any of its layers is recomputed."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def switch(_grads: tuple[torch.Tensor | None, ...]) -> None:
            for router in self.routers:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

        if output.grad_fn is not None:
            output.grad_fn.register_prehook(switch)

    def clear(self) -> None:
        """After the schedule: no ids or action left for the next forward to find."""
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
