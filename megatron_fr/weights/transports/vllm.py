"""Weight transports into vLLM servers: a broadcast through vLLM's RL weight-update protocol
(VllmTransport), and the disk transport's files reloaded in place (VllmDiskTransport).

The same group as for SGLang (DistributedTransport: hosted by the stage's sending rank, one per
pipeline stage, each engine's TP rank t at its offset + t); only the calls differ
(engine/vllm/wire.py): an engine joins through /init_weight_transfer_engine, rank 0 opens vLLM's
layerwise reload with /start_weight_update once the engines are paused, each bucket is named
with /update_weights while it is broadcast tensor by tensor, /finish_weight_update closes the
reload and labels the weights with the version, and /shutdown_weight_transfer_engine makes an
engine leave the group.

vLLM's own backends (nccl, ipc) need its trainer-side code in the learner's environment; the
engines receive instead through the project's gloo backend, loaded into vLLM's workers
(engine/vllm/gloo_transfer.py; engine/vllm/launch.py starts every vLLM server with it). So the
group is always gloo, also between GPUs: a bucket crosses host memory.

From disk, every vLLM worker reloads the directory's safetensors in place through vLLM's
/collective_rpc (dev mode) calling its worker's `reload_weights(weights_path=...)`; the version
is then set with /update_weight_version by the sync (weights/sync.py), as for any transport.
"""

from __future__ import annotations

import torch

from megatron_fr.engine.http import post_all, post_json
from megatron_fr.engine.vllm import wire
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine
from megatron_fr.weights.transports.disk import DiskTransport
from megatron_fr.weights.transports.distributed import DistributedTransport, dtype_name

RELOAD_METHOD = "reload_weights"
"""vLLM's worker method that loads weights in place from a directory (gpu_model_runner.py)."""


class VllmTransport(DistributedTransport):
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

    def join_requests(
        self, address: str, port: int, world_size: int, offsets: list[int]
    ) -> tuple[str, list[dict]]:
        bodies: list[dict] = [
            wire.init_transfer_request(
                address, port, offset, world_size, self.group_name, self.timeout_s
            )
            for offset in offsets
        ]
        return wire.INIT_TRANSFER_PATH, bodies

    def update_request(self, bucket: Bucket, flat: torch.Tensor | None) -> tuple[str, dict]:
        body = wire.update_weights_request(
            [name for name, _ in bucket],
            [dtype_name(tensor) for _, tensor in bucket],
            [list(tensor.shape) for _, tensor in bucket],
        )
        return wire.UPDATE_WEIGHTS_PATH, body

    def leave_request(self) -> tuple[str, dict]:
        return wire.SHUTDOWN_TRANSFER_PATH, {}

    def begin(self) -> None:
        post_all(self.urls, wire.START_UPDATE_PATH, None, self.timeout_s)

    def commit(self, version: str) -> None:
        body = {"weight_version": version}
        post_all(self.urls, wire.FINISH_UPDATE_PATH, body, self.timeout_s)

    def end(self) -> None:
        """finish_weight_update (commit) closed vLLM's reload: nothing left to close."""


class VllmDiskTransport(DiskTransport):
    def reload(self, version: str) -> None:
        body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(self.directory)}}
        post_all(self.urls, wire.COLLECTIVE_RPC_PATH, body, self.timeout_s)


def leave_leftover_group(url: str, timeout_s: float) -> None:
    """At connect: the group a learner that died left the engine in is released (the project's
    gloo backend answers alike whether there was one or not; its next init would replace it)."""
    post_json(url, wire.SHUTDOWN_TRANSFER_PATH, None, timeout_s)
