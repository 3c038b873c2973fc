"""Prompt files: JSONL or parquet rows -> samples, and the small datasets bundled in data/.

A sample is a dict (one row) with at least "id"; a row without one gets "<file stem>-<row>",
so ids are stable for a given file. Which other fields an environment needs is its own
business (math: "problem", "answer"; alfworld: a game spec or "game_file").
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_fr.envs.base import Sample

DATA_DIR = Path(__file__).with_name("data")
BUNDLED: dict[str, tuple[str, ...]] = {
    "math": ("math.jsonl",),
    "python_tool": ("python_tool.jsonl",),
    "alfworld": ("alfworld.jsonl", "textworld.jsonl"),
}
"""Sample files shipped with the package, so recipes and tests run offline ("alfworld": the
hand-written real ALFWorld problems, then the TextWorld game specs)."""


def load_samples(path: str | Path, limit: int | None = None) -> list[Sample]:
    """The rows of a .jsonl or .parquet file (parquet needs pyarrow), each with an "id"."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError as error:
                    raise ValueError(f"{path}:{number}: not JSON ({error})") from error
    else:
        raise ValueError(f"{path}: expected a .jsonl or .parquet prompt file")
    samples = []
    for index, row in enumerate(rows[:limit]):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {index} is not an object")
        sample = dict(row)
        if sample.get("id") is None:  # absent, or a null in a parquet column
            sample["id"] = f"{path.stem}-{index}"
        samples.append(sample)
    ids = [sample["id"] for sample in samples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate ids")
    return samples


def bundled_samples(env_name: str) -> list[Sample]:
    """The small sample dataset shipped for environment `env_name`."""
    if env_name not in BUNDLED:
        raise ValueError(f"no bundled samples for {env_name!r}; have {sorted(BUNDLED)}")
    return [sample for name in BUNDLED[env_name] for sample in load_samples(DATA_DIR / name)]
