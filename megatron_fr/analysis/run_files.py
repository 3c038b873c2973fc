"""The files a run directory holds, by name, and how they are read back.

    metrics.jsonl   one JSON object per line: a step line per optimizer step, an eval line per
                    evaluation (it carries `eval_accuracy`); the source of truth
    batches.jsonl   a line per step: each trained trajectory's lengths, reward, advantage and
                    gate decision
    config.yaml     the fully resolved config of the run

The run loop writes them (orchestrator/run_log.py, orchestrator/report.py) and repairs its own
logs with the same scan before it appends; readers here and there apply one rule: the last
line may be the remnant of a write a kill cut short and is skipped; a bad line anywhere else is
corruption and is reported with its line number.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
BATCHES_FILE = "batches.jsonl"
CONFIG_FILE = "config.yaml"


def is_number(value: object) -> bool:
    """int or float; bool is an int subclass but a flag, not a measurement."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def scan(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSON-lines run log and the byte length of its intact part.

    The last non-blank line is allowed to be unparseable (the remnant of a write cut short by a
    kill); it is left out and the intact length stops before it. Any other bad line raises.
    """
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict[str, Any]] = []
    offset = 0
    for index, line in enumerate(lines):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError as err:
                if index == last:
                    return records, offset
                raise ValueError(f"{path}:{index + 1}: malformed line ({err})") from err
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{index + 1}: expected a JSON object, got {line!r}")
            records.append(record)
        offset += len(line)
    return records, offset


def _log_path(run_dir: str | Path, name: str) -> Path:
    """run_dir/name; FileNotFoundError naming the path when it is not there."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (or is not a directory)")
    path = run_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({run_dir} has not logged {name})")
    return path


def read_run_log(run_dir: str | Path, name: str) -> list[dict[str, Any]]:
    """Every record of the JSON-lines log run_dir/name, in file order (a last line cut short
    by a kill is left out)."""
    return scan(_log_path(run_dir, name))[0]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of run_dir/metrics.jsonl, in file order (step and eval lines interleaved)."""
    return read_run_log(run_dir, METRICS_FILE)


def has_accuracy(record: Mapping[str, Any]) -> bool:
    """An evaluation line with an accuracy: not a step line, not an incomplete evaluation
    (whose eval_accuracy is null: results must skip it, not read it as 0)."""
    return is_number(record.get("eval_accuracy"))
