"""Broadcast transport: NCCL between GPUs, gloo on CPU, one process group per stage."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_fr.engine import protocol
from megatron_fr.engine.group import WeightUpdateGroup, create_weight_update_group
from megatron_fr.engine.http import EngineRequestError, post_json
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class DistributedTransport(WeightTransport):
    """Broadcast from the stage's sending rank (group rank 0) to every engine rank: NCCL on
    GPUs, gloo on CPU. One group per pipeline stage, on port ``master_port + stage``, so the
    stages send in parallel. For each bucket the engines are told what is coming
    (/update_weights_from_distributed) and receive it while that request is in flight."""

    needs_session = True

    def __init__(
        self,
        engines: list[Engine],
        master_address: str,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        group_name: str = "weight_update_group",
    ):
        super().__init__(engines, timeout_s)
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.base_group_name = group_name
        self.group: WeightUpdateGroup | None = None
        self.group_name = group_name
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(engines)))

    def connect(self, stage: int) -> None:
        self.group_name = f"{self.base_group_name}_pp{stage}"
        port = self.master_port + stage
        world_size = 1 + sum(engine.tp_size for engine in self.engines)
        offsets = [1 + sum(e.tp_size for e in self.engines[:i]) for i in range(len(self.engines))]
        joins = [
            self._pool.submit(
                post_json,
                engine.url,
                protocol.INIT_WEIGHTS_UPDATE_GROUP_PATH,
                protocol.init_weights_update_group_request(
                    self.master_address, port, offset, world_size, self.group_name, self.backend
                ),
                self.timeout_s,
            )
            for engine, offset in zip(self.engines, offsets, strict=True)
        ]
        try:
            self.group = create_weight_update_group(
                self.master_address, port, 0, world_size, self.group_name, self.backend,
                timeout_s=self.timeout_s,
            )  # fmt: skip
        except (RuntimeError, TimeoutError) as error:
            _raise_first_engine_error(joins, self.timeout_s)
            raise EngineRequestError(
                f"engines {self.urls} did not join weight group {self.group_name} at "
                f"{self.master_address}:{port} within {self.timeout_s:g} s: {error}"
            ) from error
        _raise_first_engine_error(joins, self.timeout_s)

    def send(self, bucket: Bucket) -> None:
        if self.group is None:
            raise RuntimeError("DistributedTransport.send before connect")
        body = protocol.update_weights_from_distributed_request(
            [name for name, _ in bucket],
            [_DTYPE_NAMES[tensor.dtype] for _, tensor in bucket],
            [list(tensor.shape) for _, tensor in bucket],
            group_name=self.group_name,
            flush_cache=False,
        )
        calls = [
            self._pool.submit(
                post_json, url, protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED_PATH, body, self.timeout_s
            )
            for url in self.urls
        ]
        for _, tensor in bucket:
            self.group.broadcast(tensor.contiguous())
        _raise_first_engine_error(calls, self.timeout_s)


def _raise_first_engine_error(calls: list[Future], timeout_s: float) -> None:
    for call in calls:
        call.result(timeout=timeout_s)
