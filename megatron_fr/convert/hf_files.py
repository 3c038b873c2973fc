"""Hugging Face checkpoint directories, written: what ``save_pretrained`` produces.

``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` with
``{"format": "pt"}`` metadata, and ``model.safetensors.index.json`` mapping every tensor to its
shard; several writers (one per rank) can share a directory and one index. The reader is
utils/hf_checkpoint.py (the CPU engine loads with it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_fr.utils.hf_checkpoint import INDEX_NAME

SINGLE_FILE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")


@dataclass(frozen=True)
class WrittenShard:
    """One file a writer produced, under its temporary name."""

    file: str
    names: list[str]
    nbytes: int
    parameters: int


class ShardedSafetensorsWriter:
    """Append tensors in order; a shard is written as soon as the next tensor would overflow it.

    Shards are first written as ``{prefix}-0000i.safetensors`` (the total is not known while
    streaming); ``finish()`` renames them to HF's ``model-0000i-of-0000N`` names and writes the
    index. Writers on several ranks share a directory by using distinct prefixes: each calls
    ``close()``, and one process passes all their shards, in order, to ``finalize_shards``.
    Holds at most one shard's worth of tensors.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int, prefix: str = "model"):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.prefix = prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[WrittenShard] = []
        self.total_bytes = 0
        self.tensor_count = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.tensor_count += 1

    def _flush(self) -> None:
        file = f"{self.prefix}-{len(self._shards) + 1:05d}.safetensors"
        save_file(self._pending, self.directory / file, metadata={"format": "pt"})
        parameters = sum(t.numel() for t in self._pending.values())
        self._shards.append(
            WrittenShard(file, list(self._pending), self._pending_bytes, parameters)
        )
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[WrittenShard]:
        """Write the last shard; the shards written, in order (no renaming, no index)."""
        if self._pending:
            self._flush()
        return list(self._shards)

    def finish(self) -> list[Path]:
        """Write the last shard, rename the shards to HF names and write the index."""
        return finalize_shards(self.directory, self.close())


def finalize_shards(directory: str | Path, shards: list[WrittenShard]) -> list[Path]:
    """Rename `shards` (in this order) to ``model-0000i-of-0000N.safetensors`` and write
    ``model.safetensors.index.json`` for them; returns the final paths."""
    directory, total = Path(directory), len(shards)
    weight_map, paths = {}, []
    for index, shard in enumerate(shards):
        final = directory / f"model-{index + 1:05d}-of-{total:05d}.safetensors"
        (directory / shard.file).rename(final)
        paths.append(final)
        weight_map.update(dict.fromkeys(shard.names, final.name))
    metadata = {
        "total_parameters": sum(shard.parameters for shard in shards),
        "total_size": sum(shard.nbytes for shard in shards),
    }
    index_body = {"metadata": metadata, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index_body, indent=2) + "\n")
    return paths
