"""A checkpoint's manifest: every file's size and BLAKE2b hash, written last, so that a resume
can prove a checkpoint whole before any rank reads it.

The file checks of orchestrator/resume.py see a file cut short, zero-filled or of the wrong
form; they cannot see bytes changed in place (a flipped bit in a shard keeps its size and its
torch.save framing, and loads as wrong weights). The manifest can: the first rank writes it
once every rank has written its files, each file read back and flushed to the disk first, and
the manifest itself goes to a temporary file that is flushed and renamed into place, then the
directory flushed. So a checkpoint with a manifest was finished, and one whose files disagree
with its manifest was damaged afterwards.

    RUN_DIR/checkpoints/step_00000010/manifest.json
        {"format": 1, "hash": "blake2b-128",
         "files": {"controller.json": {"size": 311, "blake2b": "9f0c..."}, ...}}

Files the manifest does not list are not looked at (a note left in the directory is harmless),
except the files a resume loads (LOADED): a manifest that leaves one of those out, as one whose
`files` is `{}` does, cannot vouch for its bytes, so the checkpoint counts as damaged.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

MANIFEST = "manifest.json"
FORMAT = 1
HASH = "blake2b-128"
_CHUNK = 1 << 20
_THREADS = min(8, os.cpu_count() or 1)
"""Files hashed at once: hashlib releases the GIL on large updates, so a checkpoint of many
shards is hashed at the speed of that many cores (or of the disk)."""
LOADED = (
    "controller.json",
    "rng/rank*.pt",
    "learner/.metadata",
    "learner/metadata.json",
    "learner/common.pt",
    "learner/*.distcp",
)
"""The files a resume loads (relative, POSIX): each one there must be in the manifest."""


def file_hash(path: Path, flush: bool = False) -> str:
    """The file's BLAKE2b-128 hex digest; with `flush`, its bytes are also forced to the disk
    (fsync works on a descriptor opened for reading), so the manifest never vouches for bytes
    still in the page cache."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
        if flush:
            os.fsync(file.fileno())
    return digest.hexdigest()


def write_manifest(checkpoint: Path) -> Path:
    """Hash every regular file of `checkpoint` and write its manifest atomically (module
    docstring); returns the manifest's path."""
    paths = [
        path
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and not path.relative_to(checkpoint).as_posix().startswith(MANIFEST)
    ]
    with ThreadPoolExecutor(_THREADS) as pool:
        hashes = list(pool.map(lambda path: file_hash(path, flush=True), paths))
    files = {
        path.relative_to(checkpoint).as_posix(): {"size": path.stat().st_size, "blake2b": digest}
        for path, digest in zip(paths, hashes, strict=True)
    }
    target = checkpoint / MANIFEST
    partial = checkpoint / f"{MANIFEST}.partial"
    with open(partial, "w") as out:
        json.dump({"format": FORMAT, "hash": HASH, "files": files}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, target)
    directory = os.open(checkpoint, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself reaches the disk
    finally:
        os.close(directory)
    return target


def manifest_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint`'s files disagree with its manifest (which must exist), naming the file;
    None when every listed file is there, a regular file of its size and hash."""
    path = checkpoint / MANIFEST
    if not path.is_file():  # a FIFO would block the read
        return f"{path}: not a regular file"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"not a format-{FORMAT} manifest")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{path}: unreadable ({error})"
    unlisted = _unlisted(checkpoint, files)
    if unlisted is not None:
        return unlisted
    with ThreadPoolExecutor(_THREADS) as pool:
        problems = pool.map(lambda item: _file_problem(checkpoint, *item), files.items())
        return next((problem for problem in problems if problem is not None), None)


def _unlisted(checkpoint: Path, files: dict) -> str | None:
    """The first file a resume would load that the manifest does not list, named; a save
    lists every file it wrote, so a gap means the manifest was damaged or replaced."""
    for path in sorted(checkpoint.rglob("*")):
        relative = path.relative_to(checkpoint).as_posix()
        loaded = any(fnmatch.fnmatchcase(relative, pattern) for pattern in LOADED)
        if loaded and relative not in files and not path.is_dir():
            return (
                f"{path}: not listed in {checkpoint / MANIFEST} ({len(files)} files listed), "
                "so nothing vouches for its bytes (the manifest was damaged or replaced)"
            )
    return None


def _file_problem(checkpoint: Path, name: str, expected: object) -> str | None:
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not isinstance(expected, dict):
        return f"{checkpoint / MANIFEST}: lists {name[:80]!r}, not a file of the checkpoint"
    file = checkpoint / relative
    try:
        status = os.stat(file)
    except OSError:
        return f"{file}: missing (the manifest lists it)"
    if not stat.S_ISREG(status.st_mode):  # a FIFO would block the read below
        return f"{file}: not a regular file (the manifest lists a file)"
    if status.st_size != expected.get("size"):
        return f"{file}: {status.st_size} bytes, the manifest says {expected.get('size')}"
    if file_hash(file) != expected.get("blake2b"):
        return f"{file}: its bytes differ from the manifest's hash (changed after it was written)"
    return None
