"""The safetensors file format, read with plain positioned reads (pread).

A file is an 8-byte little-endian header length N, N bytes of JSON mapping each tensor name to
its dtype, shape and [begin, end) byte range in the data that follows (plus an optional
"__metadata__"), then the data: C-contiguous tensors that exactly cover the rest of the file.

``read_header`` checks all of that and names the file and the fault (a truncated copy, a
half-written shard, something that is not safetensors) instead of failing later with a bare
traceback. ``TensorFile`` reads row ranges of a tensor straight into a destination tensor.
Only regular files are read (``open_regular``): opening a FIFO named like a shard would block
until something writes to it, and a device could be read forever, so both are refused.
Why not safetensors' own ``safe_open``: it maps the file, and every page a read touches counts
in the process's resident memory until the file is closed, so a rank reading its share of a
checkpoint would look (and be scheduled) as if it held the whole files; a pread costs the same
single copy and leaves nothing mapped.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}
MAX_HEADER_BYTES = 100_000_000
"""safetensors' own limit on the JSON header."""
COLUMN_BLOCK_BYTES = 64 * 2**20
"""Column slices are read as whole rows, this many bytes at a time, then cut."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file: opened without blocking
    (a FIFO would otherwise wait for a writer) and checked on the open descriptor, so a file
    swapped after a check is caught too. ValueError naming the path otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | Path) -> str:
    """The text of a regular file (see open_regular)."""
    with os.fdopen(open_regular(path), "rb") as handle:
        return handle.read().decode()


def _fault(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what} (a truncated or corrupt safetensors file?)")


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    names = [name for name, _ in pairs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tensor names repeated in the header: {repeated[:5]}")
    return dict(pairs)


def _parse_json_header(path: Path) -> tuple[dict, int, int]:
    """(header dict, data start, data size); ValueError naming the file when malformed."""
    with os.fdopen(open_regular(path), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _fault(path, f"{size} bytes, too short to hold the 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise _fault(path, f"header length {length} does not fit in the file ({size} bytes)")
        text = handle.read(length)
    try:
        header = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except RecursionError:
        raise _fault(path, "header nested deeper than JSON can be read here") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise _fault(path, f"header is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise _fault(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length, size - 8 - length


def _is_count(value: Any) -> bool:
    """A JSON integer >= 0 (not a bool, a float or a string of digits)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, info: Any, data_start: int) -> TensorEntry:
    """One header entry (JSON of any shape: a malformed one is refused, naming it)."""
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise _fault(path, f"tensor {name}: malformed header entry {str(info)[:200]}") from None
    if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
        raise _fault(path, f"tensor {name}: shape {str(shape)[:100]} is not a list of sizes")
    if not (_is_count(begin) and _is_count(end)):
        raise _fault(path, f"tensor {name}: data_offsets {str(info['data_offsets'])[:100]}")
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValueError(f"{path}: tensor {name} has unsupported dtype {str(dtype_name)[:40]}")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise _fault(
            path, f"tensor {name}: byte range [{begin}, {end}) does not hold {dtype_name} {shape}"
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, expected)


def read_header(path: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of one safetensors file, from its header alone (no tensor data is read).

    Raises ValueError naming the file when the header is malformed, when the data region is
    shorter or longer than the tensors it declares, or when tensors overlap.
    """
    path = Path(path)
    header, data_start, data_size = _parse_json_header(path)
    entries = {name: _entry(path, name, info, data_start) for name, info in header.items()}
    cursor = data_start
    for name, entry in sorted(entries.items(), key=lambda item: item[1].offset):
        if entry.offset != cursor:
            raise _fault(path, f"tensor {name} starts at byte {entry.offset}, expected {cursor}")
        cursor += entry.nbytes
    declared = cursor - data_start
    if declared > data_size:
        raise _fault(
            path, f"the header declares {declared} bytes of tensors, the file holds {data_size}"
        )
    if declared < data_size:
        raise _fault(path, f"{data_size - declared} bytes after the last tensor")
    return entries


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (no copy)."""
    return tensor.view(-1).view(torch.uint8).numpy().data


class TensorFile:
    """One open safetensors file: positioned reads of row ranges into given tensors."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = open_regular(path)
        self.bytes_read = 0

    def close(self) -> None:
        os.close(self._fd)

    def _read_into(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < len(buffer):
            count = os.preadv(self._fd, [buffer[done:]], offset + done)
            if count == 0:
                raise _fault(self.path, f"ended at byte {offset + done} while reading tensor data")
            done += count
        self.bytes_read += done

    def read_rows(self, entry: TensorEntry, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows [start, stop) of `entry` (dim 0; elements of a 1-D tensor) into `out`, which
        holds exactly that many elements in any dtype (converted as ``copy_`` does)."""
        row_bytes = entry.nbytes // entry.rows
        view = out.reshape(-1) if out.is_contiguous() else None
        if view is not None and out.dtype == entry.dtype:
            self._read_into(_bytes_of(view), entry.offset + start * row_bytes)
            return
        staging = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
        self._read_into(_bytes_of(staging), entry.offset + start * row_bytes)
        out.copy_(staging.view(entry.dtype).view(out.shape))

    def read_columns(self, entry: TensorEntry, start: int, stop: int, out: torch.Tensor) -> None:
        """Columns [start, stop) of a 2-D `entry` into `out` [rows, stop - start]: whole rows
        are read a block at a time (a strided range is not one file range) and cut."""
        rows, columns = entry.shape
        block = max(1, COLUMN_BLOCK_BYTES // (columns * entry.dtype.itemsize))
        for first in range(0, rows, block):
            last = min(rows, first + block)
            staging = torch.empty((last - first, columns), dtype=entry.dtype)
            self.read_rows(entry, first, last, staging)
            out[first:last].copy_(staging[:, start:stop])
