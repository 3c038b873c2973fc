"""Hugging Face checkpoint directories: find every tensor, read tensors, write sharded files.

The reader looks at file headers only until a tensor is asked for, so a converter can check
names and shapes of a 60 GB checkpoint before reading any data, then read only what it needs.
Which file holds a tensor is what ``model.safetensors.index.json`` says (its weight_map), even
when a stray copy sits in another shard; without an index every ``*.safetensors`` file is read
and a name found in two of them is refused. The writer produces what ``save_pretrained``
produces: ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_bytes`` with
``{"format": "pt"}`` metadata, and ``model.safetensors.index.json`` mapping every tensor to its
shard; several writers (one per rank) can share a directory and one index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_fr.convert.safetensors_io import TensorEntry, TensorFile, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")


def _indexed_tensors(directory: Path) -> dict[str, TensorEntry]:
    """Tensors by name, each from the file the index names for it."""
    index = directory / INDEX_NAME
    weight_map = _weight_map(index)
    headers: dict[str, dict[str, TensorEntry]] = {}
    for file in sorted(set(weight_map.values())):
        path = directory / file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {INDEX_NAME} but is not a file there")
        headers[file] = read_header(path)
    tensors = {}
    for name, file in weight_map.items():
        if name not in headers[file]:
            raise ValueError(f"{INDEX_NAME} maps {name} to {file}, which does not hold it")
        tensors[name] = headers[file][name]
    for file, entries in headers.items():
        unlisted = sorted(name for name in entries if name not in weight_map)
        if unlisted:
            raise ValueError(
                f"{directory / file} holds tensors {INDEX_NAME} does not list: {unlisted[:5]}"
            )
    return tensors


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> file name map; ValueError naming the index when it is not
    one, or names a file outside its directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{index}: not a safetensors index ({error!r})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise ValueError(f"{index}: weight_map must map tensor names to file names")
    outside = sorted(file for file in set(weight_map.values()) if Path(file).name != file)
    if outside:
        raise ValueError(f"{index}: weight_map names {outside[0]!r}, not a file of its directory")
    return weight_map


def _unindexed_tensors(directory: Path) -> dict[str, TensorEntry]:
    """Tensors by name from every safetensors file; a name in two files is refused."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory}: no {INDEX_NAME} and no *.safetensors file (only safetensors "
            f"checkpoints are read)"
        )
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        for name, entry in read_header(path).items():
            if name in tensors:
                raise ValueError(
                    f"{name} is in both {tensors[name].file.name} and {path.name} of "
                    f"{directory}, and there is no {INDEX_NAME} to say which one to use"
                )
            tensors[name] = entry
    return tensors


class HFCheckpointReader:
    """The tensors of an HF checkpoint directory (index + shards, or files alone), lazily.

    Use as a context manager (or call close()) to release the open files.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        indexed = (self.directory / INDEX_NAME).exists()
        read = _indexed_tensors if indexed else _unindexed_tensors
        self.tensors: dict[str, TensorEntry] = read(self.directory)
        self._files: dict[Path, TensorFile] = {}

    def file(self, name: str) -> tuple[TensorFile, TensorEntry]:
        """The open file holding tensor `name`, and where in it the tensor is."""
        entry = self.tensors[name]
        if entry.file not in self._files:
            self._files[entry.file] = TensorFile(entry.file)
        return self._files[entry.file], entry

    @property
    def bytes_read(self) -> int:
        return sum(file.bytes_read for file in self._files.values())

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, whole."""
        out = {}
        for name in names:
            file, entry = self.file(name)
            out[name] = torch.empty(entry.shape, dtype=entry.dtype)
            file.read_rows(entry, 0, entry.rows, out[name])
        return out

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_files"):  # __init__ may have failed before opening anything
            self.close()


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
