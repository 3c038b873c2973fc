"""Disk transport: safetensors on a shared file system, reloaded by /update_weights_from_disk."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_fr.convert.hf_files import INDEX_NAME, ShardedSafetensorsWriter
from megatron_fr.engine import protocol
from megatron_fr.engine.http import post_all
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport


class DiskTransport(WeightTransport):
    """Each stage writes its buckets as safetensors under ``directory/stage-K/``; on commit
    rank 0 writes one index over all stages and every engine reloads from the directory. The
    directory must be visible to the engines (shared file system)."""

    def __init__(self, engines: list[Engine], directory: str | Path, timeout_s: float = 600.0):
        super().__init__(engines, timeout_s)
        self.directory = Path(directory)
        self._writer: ShardedSafetensorsWriter | None = None

    def connect(self, stage: int) -> None:
        self.stage_dir = self.directory / f"stage-{stage}"
        self.stage_dir.mkdir(parents=True, exist_ok=True)

    def send(self, bucket: Bucket) -> None:
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
        post_all(self.urls, protocol.UPDATE_WEIGHTS_FROM_DISK_PATH, body, self.timeout_s)
