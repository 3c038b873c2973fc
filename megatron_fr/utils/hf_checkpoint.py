"""Hugging Face checkpoint directories, read: find every tensor, read tensors.

The reader looks at file headers only until a tensor is asked for, so a converter can check
names and shapes of a 60 GB checkpoint before reading any data, then read only what it needs.
Which file holds a tensor is what ``model.safetensors.index.json`` says (its weight_map), even
when a stray copy sits in another shard; without an index every ``*.safetensors`` file is read
and a name found in two of them is refused. Only regular files are opened (utils/safetensors_io:
a FIFO or a device named like a shard is refused, never waited on). Shared by the converters
(convert/) and the CPU engine's disk loads (engine/cpu/weights.py), which sits below convert.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_fr.utils.safetensors_io import TensorEntry, TensorFile, read_header, read_regular
from megatron_fr.utils.strict_json import loads_unique

INDEX_NAME = "model.safetensors.index.json"


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
        weight_map = loads_unique(read_regular(index))["weight_map"]
    except RecursionError:
        raise ValueError(f"{index}: nested deeper than JSON can be read here") from None
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_files"):  # __init__ may have failed before opening anything
            self.close()
