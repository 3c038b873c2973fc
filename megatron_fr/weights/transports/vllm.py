"""Weight transports into vLLM servers: a broadcast through vLLM's RL weight-update protocol
(VllmTransport), and the disk transport's files reloaded in place (VllmDiskTransport).

The same group as for SGLang (DistributedTransport: hosted by the stage's sending rank, one per
pipeline stage, each engine's TP rank t at its offset + t); only the calls differ (the vLLM
side of the engine interface, engine/vllm/wire.py): an engine joins through
/init_weight_transfer_engine, rank 0 opens vLLM's layerwise reload with /start_weight_update
once the engines are paused, each bucket is named with /update_weights while it is broadcast
tensor by tensor, /finish_weight_update closes the reload and labels the weights with the
version, and /shutdown_weight_transfer_engine makes an engine leave the group.

vLLM's own backends (nccl, ipc) need its trainer-side code in the learner's environment; the
engines receive instead through the project's gloo backend, loaded into vLLM's workers
(engine/vllm/gloo_transfer.py; engine/vllm/launch.py starts every vLLM server with it). So the
group is always gloo, also between GPUs: a bucket crosses host memory.

From disk, every vLLM worker reloads the directory's safetensors in place through vLLM's
/collective_rpc (dev mode) calling its worker's `reload_weights(weights_path=...)`; the version
is then set with /update_weight_version by the sync (weights/sync.py), as for any transport.
"""

from __future__ import annotations

from megatron_fr.engine.server_info import EngineKind
from megatron_fr.weights.transports.base import Engine
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import DistributedTransport


class VllmTransport(DistributedTransport):
    kind: EngineKind | None = "vllm"

    def __init__(
        self,
        engines: list[Engine],
        master_address: str | None,
        master_port: int,
        timeout_s: float = 120.0,
        group_name: str = "weight_update_group",
    ):
        super().__init__(engines, master_address, master_port, "gloo", timeout_s, group_name)

    def check_engines(self) -> None:
        for engine in self.engines:
            if engine.pp_size > 1 or engine.dp_replicas > 1:
                raise ValueError(
                    f"{engine.url}: vLLM with pipeline_parallel_size {engine.pp_size} and "
                    f"data_parallel_size {engine.dp_replicas}: the project pushes weights into "
                    "one tensor-parallel replica per server; serve with pp 1 and dp 1"
                )


class VllmDiskTransport(DiskTransport):
    kind: EngineKind | None = "vllm"
