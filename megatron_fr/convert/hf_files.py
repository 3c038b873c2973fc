"""Hugging Face checkpoint files: read tensors one by one, write sharded safetensors.

The reader looks at file headers only until a tensor is asked for, so a converter can check
names and shapes of a 60 GB checkpoint before reading any data, then stream it layer by layer.
The writer produces what ``save_pretrained`` produces: ``model-0000i-of-0000N.safetensors``
shards of at most ``max_shard_bytes`` with ``{"format": "pt"}`` metadata, and
``model.safetensors.index.json`` mapping every tensor to its shard.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class HFCheckpointReader:
    """The tensors of an HF checkpoint directory (single file or index + shards), lazily."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._weight_files():
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    view = handle.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{name}: unsupported dtype {view.get_dtype()} in {file}")
                    self.tensors[name] = TensorInfo(file, tuple(view.get_shape()), dtype)

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_NAME
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.directory / file for file in weight_map.values()})
        elif (self.directory / SINGLE_FILE_NAME).exists():
            files = [self.directory / SINGLE_FILE_NAME]
        else:
            raise FileNotFoundError(
                f"{self.directory}: no {INDEX_NAME} or {SINGLE_FILE_NAME} (only safetensors "
                f"checkpoints are read)"
            )
        for file in files:
            if not file.exists():
                raise FileNotFoundError(f"{file} is listed in {INDEX_NAME} but missing")
        return files

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in file_names:
                    out[name] = handle.get_tensor(name)
        return out


class ShardedSafetensorsWriter:
    """Append tensors in order; a shard is written as soon as the next tensor would overflow it.

    Shards are first written as ``model-0000i.safetensors`` (the total is not known while
    streaming) and renamed to HF's ``-of-0000N`` names by ``finish()``, which also writes the
    index. Holds at most one shard's worth of tensors.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self.tensor_count = 0
        self.total_parameters = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.tensor_count += 1
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        save_file(self._pending, self._shard_path(len(self._shards)), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def _shard_path(self, index: int, total: int | None = None) -> Path:
        suffix = "" if total is None else f"-of-{total:05d}"
        return self.directory / f"model-{index + 1:05d}{suffix}.safetensors"

    def finish(self) -> list[Path]:
        """Write the last shard and the index; return the shard paths."""
        if self._pending:
            self._flush()
        total, weight_map, paths = len(self._shards), {}, []
        for index, names in enumerate(self._shards):
            final = self._shard_path(index, total)
            self._shard_path(index).rename(final)
            paths.append(final)
            weight_map.update(dict.fromkeys(names, final.name))
        metadata = {"total_parameters": self.total_parameters, "total_size": self.total_bytes}
        index_body = {"metadata": metadata, "weight_map": weight_map}
        (self.directory / INDEX_NAME).write_text(json.dumps(index_body, indent=2) + "\n")
        return paths
