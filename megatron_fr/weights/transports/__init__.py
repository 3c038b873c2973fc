"""Weight transports, one file each, chosen by name (``WeightSyncConfig.transport``)."""

from __future__ import annotations

import torch

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.weights.transports.base import Engine, WeightTransport, resolve_engine
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import DistributedTransport
from megatron_fr.weights.transports.tensor import TensorTransport
from megatron_fr.weights.transports.vllm import VllmDiskTransport, VllmTransport

__all__ = ["Engine", "WeightTransport", "build_transport", "resolve_engine"]


def build_transport(
    config: WeightSyncConfig, engines: list[Engine], group_name: str = "weight_update_group"
) -> WeightTransport:
    """The transport `config` names, for resolved engines (tp_size and kind known); a broadcast
    one forms its groups under `group_name` (one per stage: group_name_pp<stage>). vLLM
    engines take the broadcast and the disk reload through their own routes
    (weights/transports/vllm.py)."""
    if any(engine.kind == "vllm" for engine in engines):
        if config.transport == "tensor":
            raise ValueError(
                "weights.transport 'tensor': vLLM engines receive weights by broadcast "
                "(distributed) or from disk"
            )
        if config.transport == "disk":
            return VllmDiskTransport(engines, _directory(config), config.timeout_s)
        return VllmTransport(
            engines, config.master_address, config.master_port, config.timeout_s, group_name
        )
    if config.transport == "distributed":
        backend = config.backend
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
