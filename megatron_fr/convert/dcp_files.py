"""A megatron torch_dist checkpoint's files, checked without loading a tensor.

A file of a checkpoint can be damaged after it was written whole: a disk that filled, a copy
cut short, a node that lost power with writes in its cache (a file of the right size full of
zeros). Loaded, such a file fails deep in torch's reader (EOFError, an unpickling error), in
the middle of a collective when ranks load together. What is checked here, from the files
alone and cheaply (a few bytes per stored item):

    metadata.json   megatron's checkpoint description, a JSON object naming its backend
    .metadata       torch's checkpoint index, readable
    each shard      the index lists: a regular file long enough for its items, each item
                    beginning and ending as the torch.save archive torch writes it as (a
                    zero-filled or overwritten file does not)
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

ARCHIVE_HEAD, ARCHIVE_END = b"PK\x03\x04", b"PK\x05\x06"
"""A torch.save archive (a zip file): its first local header, and its end-of-directory record
22 bytes before its end (torch writes no zip comment)."""


def megatron_checkpoint_problem(directory: Path) -> str | None:
    """What is wrong with the checkpoint `directory`'s files, naming the file; None if
    nothing the files alone can show."""
    if not directory.is_dir():
        return f"{directory}: not a directory"
    return _description_problem(directory) or _shards_problem(directory)


def read_json(file: Path) -> tuple[object, str | None]:
    """(the file's JSON, None), or (None, why not, naming the file)."""
    if not file.is_file():
        return None, f"{file}: missing"
    try:
        return json.loads(file.read_text()), None
    except (OSError, ValueError) as error:
        return None, f"{file}: not readable JSON ({error})"


def _description_problem(directory: Path) -> str | None:
    file = directory / "metadata.json"
    description, problem = read_json(file)
    if problem is None and not (isinstance(description, dict) and "sharded_backend" in description):
        problem = f"{file}: not a megatron checkpoint description"
    return problem


def _shards_problem(directory: Path) -> str | None:
    from torch.distributed.checkpoint import FileSystemReader

    index = directory / ".metadata"
    if not index.is_file():
        return f"{index}: missing"
    try:
        items = FileSystemReader(str(index.parent)).read_metadata().storage_data.values()
        by_file = defaultdict(list)
        for item in items:
            by_file[item.relative_path].append(item)
    except Exception as error:  # whatever unpickling damaged bytes raises
        return f"{index}: unreadable ({type(error).__name__}: {error})"
    for name, file_items in sorted(by_file.items()):
        problem = _shard_problem(index.parent / name, file_items, index)
        if problem is not None:
            return problem
    return None


def _shard_problem(shard: Path, items: list, index: Path) -> str | None:
    if not shard.is_file():
        return f"{shard}: missing (listed in {index})"
    size = shard.stat().st_size
    needed = max(item.offset + item.length for item in items)
    if size < needed:
        return f"{shard}: {size} bytes, shorter than the {needed} its items need (cut short?)"
    with open(shard, "rb") as handle:
        for item in items:
            if getattr(item, "transform_descriptors", None):
                continue  # stored transformed (e.g. compressed): no archive to recognise
            handle.seek(item.offset)
            head = handle.read(4)
            handle.seek(item.offset + item.length - 22)
            if head != ARCHIVE_HEAD or handle.read(4) != ARCHIVE_END:
                return (
                    f"{shard}: the item at byte {item.offset} is not a torch.save archive "
                    "(zero-filled or overwritten?)"
                )
    return None
