"""What a result came from: the model's weights by content and the code by commit, so that a
table or a run directory says which starting model and which code produced it (two warm
starts that differ in the sixth digit train differently over hundreds of RL steps)."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

WEIGHT_FILES = "*.safetensors"
CHUNK = 1 << 20
HASHED_AT_START_BYTES = 1 << 30
"""A run hashes its model's weights itself only up to this size (a demo model); a larger one
is named by the hash its maker recorded, if any (a 60 GB checkpoint would take minutes)."""
MAKER_RECORD = "warm_start.json"


def weights_sha256(model_dir: str | Path) -> str | None:
    """sha256 over the model directory's safetensors files, in name order (each file's name,
    then its bytes); None when there are none (not a model directory written here)."""
    files = sorted(Path(model_dir).glob(WEIGHT_FILES))
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def source_commit(start: Path = Path(__file__)) -> str | None:
    """The git commit of the checkout this package runs from, with "-dirty" when tracked files
    changed; None outside a git checkout (an installed wheel) or without git."""
    try:
        commit = _git(start, "rev-parse", "HEAD")
        dirty = _git(start, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if dirty else commit


def _git(start: Path, *args: str) -> str:
    where = str(start.resolve().parent)
    done = subprocess.run(
        ["git", "-C", where, *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def model_sha256(model_dir: str | Path) -> str | None:
    """The weights' sha256 as its maker recorded it (demo/warm_start.py's record), else
    computed here for a model of at most HASHED_AT_START_BYTES; None otherwise."""
    record = Path(model_dir) / MAKER_RECORD
    if record.is_file():
        try:
            recorded = json.loads(record.read_text())["report"].get("model_sha256")
        except (ValueError, KeyError, TypeError, AttributeError):
            recorded = None
        if recorded:
            return str(recorded)
    size = sum(path.stat().st_size for path in Path(model_dir).glob(WEIGHT_FILES))
    return weights_sha256(model_dir) if size <= HASHED_AT_START_BYTES else None


def run_provenance(model_dir: str | Path) -> dict[str, str | None]:
    """What a run directory records about where it started: the model's hash and the commit."""
    return {"model_sha256": model_sha256(model_dir), "commit": source_commit()}
