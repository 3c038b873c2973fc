"""What each engine kind can serve, as plain data: the one table the recipe's validation and the
engine side (engine/backends.py, which adds each kind's behaviour: its wire, launch command
and environment) both read.

It sits in config because a recipe is refused at load time for what its engines cannot serve
(config/run.py), before anything imports an engine, and config is the package's lowest layer.
Adding an engine kind is its folder under engine/, one line in engine/backends.py's registry
and its row here (engine/backends.py checks at import that the two list the same kinds).
"""

from __future__ import annotations

from typing import Literal

from megatron_fr.config.base import StrictModel, StrictTuple

EngineKind = Literal["sglang", "vllm", "cpu"]
"""rollout.engine.kind's values, the registry's keys."""


class EngineCapabilities(StrictModel):
    """What the project reads from and sends to engines of one kind."""

    name: str
    """How messages name the kind ("SGLang")."""
    routed_experts: bool
    """Answers a request's routed experts (MoE routing replay)."""
    top_logprobs: bool
    """Answers the top-K log-probs of each token (the top-K gate)."""
    pause_modes: StrictTuple[Literal["abort", "retract", "in_place"]]
    """The pauses of a weight sync it has (weights.pause_mode)."""
    weight_readback: Literal["any", "listed_families", "none"]
    """Reads a tensor back after a sync (weights.spot_check): for any model, only for the
    families its wire lists (SGLang's /get_weights_by_name), or not at all."""
    weight_transports: StrictTuple[Literal["distributed", "tensor", "disk"]]
    """The weights.transport values it takes."""
    weight_group_backend: Literal["gloo"] | None
    """The collective backend its weight group must use whatever weights.backend says
    (vLLM's servers receive through the project's gloo extension), or None."""
    dense_demo_model: bool
    """The CPU demos make the dense variant of their tiny model for it (demo/tiny_models.py)."""
    server_gpus: Literal["required", "none", "any"]
    """What the Slurm launcher allows its servers: GPUs required, none, or either."""


ENGINE_KINDS: dict[str, EngineCapabilities] = {
    "sglang": EngineCapabilities(
        name="SGLang",
        routed_experts=True,
        top_logprobs=True,
        pause_modes=("abort", "retract", "in_place"),
        weight_readback="listed_families",
        weight_transports=("distributed", "tensor", "disk"),
        weight_group_backend=None,
        dense_demo_model=False,
        server_gpus="required",
    ),
    "vllm": EngineCapabilities(
        name="vLLM",
        routed_experts=False,
        top_logprobs=False,
        pause_modes=("abort", "in_place"),
        weight_readback="none",
        weight_transports=("distributed", "disk"),
        weight_group_backend="gloo",
        dense_demo_model=True,
        server_gpus="any",
    ),
    "cpu": EngineCapabilities(
        name="the CPU engine",
        routed_experts=True,
        top_logprobs=True,
        pause_modes=("abort", "retract", "in_place"),
        weight_readback="any",
        weight_transports=("distributed", "tensor", "disk"),
        weight_group_backend=None,
        dense_demo_model=False,
        server_gpus="none",
    ),
}
"""Each kind's capabilities, by rollout.engine.kind."""


def capabilities(kind: str) -> EngineCapabilities:
    """ENGINE_KINDS[kind]; ValueError naming the kinds for another."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind {kind!r}: one of {', '.join(ENGINE_KINDS)}")
    return ENGINE_KINDS[kind]
