"""How one pipeline stage's buckets reach the engines: broadcast, colocated tensors, or disk.

One small interface; the sync (``weights/sync.py``) calls ``connect`` once, ``send`` for each
of the stage's buckets on the stage's sending rank, and ``commit`` on global rank 0 after
every stage has sent. Every engine call has a deadline (``timeout_s``).
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_fr.convert.hf_files import INDEX_NAME, ShardedSafetensorsWriter
from megatron_fr.rollout import protocol
from megatron_fr.weights.engine_http import EngineRequestError, post_all, post_json
from megatron_fr.weights.group import WeightUpdateGroup, create_weight_update_group
from megatron_fr.weights.reshard import Bucket

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Engine:
    """An inference server: its URL and how many ranks it has in a weight-update group."""

    url: str
    tp_size: int = 1


class WeightTransport(ABC):
    def __init__(self, engines: list[Engine], timeout_s: float):
        if not engines:
            raise ValueError("a weight transport needs at least one engine")
        self.engines, self.timeout_s = engines, timeout_s

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def connect(self, stage: int) -> None:  # noqa: B027  (optional hook)
        """Once, on the stage's sending rank, before the first sync."""

    @abstractmethod
    def send(self, bucket: Bucket) -> None:
        """One bucket of full HF tensors, on the stage's sending rank."""

    def finish_stage(self) -> None:  # noqa: B027  (optional hook)
        """After the stage's last bucket, on its sending rank."""

    def commit(self, version: str) -> None:  # noqa: B027  (optional hook)
        """On global rank 0, after every stage has sent everything."""


class DistributedTransport(WeightTransport):
    """Broadcast from the stage's sending rank (group rank 0) to every engine rank: NCCL on
    GPUs, gloo on CPU. One group per pipeline stage, on port ``master_port + stage``, so the
    stages send in parallel. For each bucket the engines are told what is coming
    (/update_weights_from_distributed) and receive it while that request is in flight."""

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
                "/init_weights_update_group",
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
                post_json, url, "/update_weights_from_distributed", body, self.timeout_s
            )
            for url in self.urls
        ]
        for _, tensor in bucket:
            self.group.broadcast(tensor.contiguous())
        _raise_first_engine_error(calls, self.timeout_s)


class TensorTransport(WeightTransport):
    """Colocated engines (same GPUs as the learner): tensors are handed over by CUDA IPC
    handles through SGLang's /update_weights_from_tensor, one serialized list per engine TP
    rank. Needs SGLang's serializer, so it works only where SGLang itself runs (CUDA)."""

    def send(self, bucket: Bucket) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer
        except ImportError as error:
            raise RuntimeError(
                "the tensor transport needs an importable SGLang (a CUDA machine); use the "
                "distributed or disk transport here"
            ) from error
        for engine in self.engines:
            payload = MultiprocessingSerializer.serialize(bucket, output_str=True)
            body = protocol.update_weights_from_tensor_request(
                [payload] * engine.tp_size, flush_cache=False
            )
            post_json(engine.url, "/update_weights_from_tensor", body, self.timeout_s)


class DiskTransport(WeightTransport):
    """Each stage writes its buckets as safetensors under ``directory/stage-K/``; on commit
    rank 0 writes one index over all stages and every engine reloads from the directory. The
    directory must be visible to the engines (shared file system)."""

    def __init__(self, engines: list[Engine], directory: str | Path, timeout_s: float = 600.0):
        super().__init__(engines, timeout_s)
        self.directory = Path(directory)
        self._writer: ShardedSafetensorsWriter | None = None
        self._lock = threading.Lock()

    def connect(self, stage: int) -> None:
        self.stage_dir = self.directory / f"stage-{stage}"
        self.stage_dir.mkdir(parents=True, exist_ok=True)

    def send(self, bucket: Bucket) -> None:
        with self._lock:
            if self._writer is None:
                for old in self.stage_dir.glob("*"):
                    old.unlink()
                self._writer = ShardedSafetensorsWriter(self.stage_dir, max_shard_bytes=2**62)
            for name, tensor in bucket:
                self._writer.add(name, tensor)

    def finish_stage(self) -> None:
        if self._writer is not None:
            self._writer.finish()
            self._writer = None

    def commit(self, version: str) -> None:
        weight_map = {}
        for index_file in sorted(self.directory.glob(f"stage-*/{INDEX_NAME}")):
            stage_map = json.loads(index_file.read_text())["weight_map"]
            prefix = index_file.parent.name
            weight_map.update({name: f"{prefix}/{file}" for name, file in stage_map.items()})
        index = {"metadata": {}, "weight_map": weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index))
        body = protocol.update_weights_from_disk_request(
            str(self.directory), weight_version=version, flush_cache=True
        )
        post_all(self.urls, "/update_weights_from_disk", body, self.timeout_s)


def _raise_first_engine_error(calls: list[Future], timeout_s: float) -> None:
    for call in calls:
        call.result(timeout=timeout_s)
