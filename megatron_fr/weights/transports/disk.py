"""Disk transport: safetensors on a shared file system, reloaded by the engines (SGLang's
/update_weights_from_disk, vLLM's reload_weights: engine/wire.py's reload_from_disk)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from megatron_fr.utils.hf_checkpoint import INDEX_NAME
from megatron_fr.weights.reshard import Bucket
from megatron_fr.weights.transports.base import Engine, WeightTransport

STAGE_FILES = "stage*-*.safetensors"


def stage_file(stage: int, index: int) -> str:
    return f"stage{stage:02d}-{index:05d}.safetensors"


class DiskTransport(WeightTransport):
    """Every stage writes its buckets as ``directory/stageKK-NNNNN.safetensors`` (one file per
    bucket), directly in ``directory``: SGLang's loader globs ``*.safetensors`` in the model
    path itself (DefaultModelLoader._prepare_weights), never in sub-directories, and keeps
    the files the index names. On commit rank 0 writes ``model.safetensors.index.json`` over
    the files present and every engine reloads from the directory. The directory must be
    visible to the engines (shared file system); only these files are ever deleted there."""

    def __init__(self, engines: list[Engine], directory: str | Path, timeout_s: float = 600.0):
        super().__init__(engines, timeout_s)
        self.directory = Path(directory)
        self.stage: int | None = None
        self._written = 0

    def connect(self, stage: int) -> None:
        self.stage = stage
        self.directory.mkdir(parents=True, exist_ok=True)
        if stage == 0:  # the stages are fixed for the run: files of an earlier layout go
            self._remove(STAGE_FILES)
            (self.directory / INDEX_NAME).unlink(missing_ok=True)

    def _remove(self, pattern: str) -> None:
        for old in self.directory.glob(pattern):
            old.unlink()

    def send(self, bucket: Bucket) -> None:
        if self.stage is None:
            raise RuntimeError("DiskTransport.send before connect")
        if self._written == 0:  # this stage's files of the previous sync
            self._remove(f"stage{self.stage:02d}-*.safetensors")
        tensors = {name: tensor.contiguous() for name, tensor in bucket}
        path = self.directory / stage_file(self.stage, self._written)
        save_file(tensors, path, metadata={"format": "pt"})
        self._written += 1

    def finish_stage(self) -> None:
        self._written = 0

    def commit(self, version: str) -> None:
        weight_map: dict[str, str] = {}  # HF tensor name -> the file holding it
        total = 0
        for file in sorted(self.directory.glob(STAGE_FILES)):
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    if name in weight_map:
                        raise ValueError(f"{name} written twice ({weight_map[name]}, {file.name})")
                    weight_map[name] = file.name
            total += file.stat().st_size
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        self.reload(version)

    def reload(self, version: str) -> None:
        """Every engine loads the directory's files in place."""
        self.on_every_engine(
            lambda url: self.wire.reload_from_disk(url, self.directory, version, self.timeout_s)
        )
