"""Weight transports, one file each, chosen by name (``WeightSyncConfig.transport``)."""

from __future__ import annotations

import torch

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine.backends import backend_for
from megatron_fr.weights.transports.base import Engine, WeightTransport, resolve_engine
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import DistributedTransport
from megatron_fr.weights.transports.tensor import TensorTransport

__all__ = ["Engine", "WeightTransport", "build_transport", "resolve_engine"]


def build_transport(
    config: WeightSyncConfig, engines: list[Engine], group_name: str = "weight_update_group"
) -> WeightTransport:
    """The transport `config` names, for resolved engines (tp_size and kind known); a broadcast
    one forms its groups under `group_name` (one per stage: group_name_pp<stage>). Each kind
    reaches its engines through its own wire (the transport's `wire`); a transport the kind
    does not take is refused, and a kind whose servers receive over a backend of their own
    (vLLM's gloo extension) gets it whatever weights.backend says (config/engine_kinds.py)."""
    backends = {backend_for(engine.kind) for engine in engines}
    for engine_backend in backends:
        accepted = engine_backend.capabilities.weight_transports
        if config.transport not in accepted:
            raise ValueError(
                f"weights.transport {config.transport!r}: {engine_backend.name} engines receive "
                f"weights by {' or '.join(accepted)} only"
            )
    if config.transport == "distributed":
        forced = [b.capabilities.weight_group_backend for b in backends]
        backend: str = next((name for name in forced if name), config.backend)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        return DistributedTransport(
            engines,
            config.master_address,
            config.master_port,
            backend,
            config.timeout_s,
            group_name,
            flatten=config.flattened(backend),
        )
    if config.transport == "tensor":
        return TensorTransport(engines, config.timeout_s)
    return DiskTransport(engines, _directory(config), config.timeout_s)


def _directory(config: WeightSyncConfig) -> str:
    if config.directory is None:  # the validator refused it already, unless model_construct()
        raise ValueError("transport 'disk' needs directory (shared with the engines)")
    return config.directory
