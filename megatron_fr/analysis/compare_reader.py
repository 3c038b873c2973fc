"""The one reader `compare` reads its run directories through, so that a damaged or foreign run
directory is refused in one line naming its file and line, and never enters a table.

A comparison reads back runs that may have been interrupted, copied, edited by hand or made by
something else in its --out; read with the run log's own reader, a malformed line surfaced as
an IndexError, KeyError, RecursionError or UnicodeDecodeError deep in the summary, and a run
of one line (`{"step": 2, "eval_accuracy": 0.5}`) or with a step of 1e999 was summarised as if
it were a run. Here every record is checked for the fields the summary uses (each a finite
number in its range, the step an integer), and a run is counted finished only when it logged
every step 1..N once, in order, evaluated at step N, has at least one complete evaluation and
a config.yaml that is a YAML mapping:

    metrics.jsonl   a regular file of at most MAX_BYTES, UTF-8, one JSON object a line; the
                    last line may be cut short (a kill), any other bad line is an error
    config.yaml     a regular file of at most MAX_CONFIG_BYTES, UTF-8, a YAML mapping, its
                    `# key: value` header lines (what the run started from) read
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_fr.analysis.run_files import CONFIG_FILE, METRICS_FILE

MAX_BYTES = 1 << 30
"""A metrics.jsonl past 1 GiB is no run of this project (a line per step and evaluation)."""
MAX_CONFIG_BYTES = 16 << 20
MAX_STEP = 10**9
FRACTIONS = ("eval_accuracy", "acceptance_rate")
"""Fields read as shares: finite, 0 to 1."""
COUNTS = ("response_length_mean", "rollouts_total")
"""Fields read as amounts: finite, at least 0."""
VALUES = ("reward_mean", "sequence_kl_mean", "lag_mean")
"""Fields read as any finite number."""
MAY_BE_NAN = ("sequence_kl_mean",)
"""A step whose loss was not finite is skipped and logs its KL as NaN: no value, not garbage
(the summary leaves it out)."""


class RunDirError(ValueError):
    """A run directory `compare` cannot read as a run, with the file (and line) and why."""


@dataclass(frozen=True)
class RunRecords:
    """A finished run's checked records and its config.yaml header."""

    records: list[dict[str, Any]]
    header: dict[str, str]


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of run_dir/metrics.jsonl, each checked (module docstring); RunDirError
    naming the file and line of the first that is not."""
    path = run_dir / METRICS_FILE
    data = _regular_bytes(path, MAX_BYTES)
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for index, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = _parse(raw)
        except RunDirError as error:
            if index == last and not data.endswith(b"\n"):
                break  # the line a kill cut short
            raise RunDirError(f"{path}:{index + 1}: {error}") from None
        records.append(record)
    return records


def state(run_dir: Path, steps: int) -> str:
    """ "missing" (no metrics.jsonl: not started), "partial" (to be trained on: train resumes
    it) or "finished" (logged an evaluation at step `steps`); RunDirError when its records are
    malformed (training into it would fail on them, or mix them into the results)."""
    if not (run_dir / METRICS_FILE).exists() and not (run_dir / METRICS_FILE).is_symlink():
        return "missing"
    records = read_records(run_dir)
    done = any(r["step"] == steps and "eval_accuracy" in r for r in records)
    return "finished" if done else "partial"


def read_finished(run_dir: Path, steps: int) -> RunRecords:
    """A finished run of `steps` steps, checked whole (module docstring)."""
    records = read_records(run_dir)
    path = run_dir / METRICS_FILE
    logged = [r["step"] for r in records if "reward_mean" in r]
    if logged != list(range(1, steps + 1)):
        raise RunDirError(
            f"{path}: not a run of {steps} steps (its step lines are {_span(logged)}, not each "
            f"of 1 to {steps} once, in order); move it out of the comparison's directory"
        )
    evals = [r for r in records if "eval_accuracy" in r]
    if not any(r["step"] == steps for r in evals):
        raise RunDirError(f"{path}: no evaluation at step {steps}, its last")
    if not any(r["eval_accuracy"] is not None for r in evals):
        raise RunDirError(f"{path}: no complete evaluation (every eval_accuracy is null)")
    return RunRecords(records, read_header(run_dir))


def read_header(run_dir: Path) -> dict[str, str]:
    """The `# key: value` lines above run_dir/config.yaml, after the file is checked to be the
    YAML mapping a run writes."""
    path = run_dir / CONFIG_FILE
    try:
        text = _regular_bytes(path, MAX_CONFIG_BYTES).decode("utf-8")
        config = yaml.safe_load(text)
    except UnicodeDecodeError as error:
        raise RunDirError(f"{path}: not UTF-8 (byte {error.start})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        raise RunDirError(f"{path}: {where}not YAML ({getattr(error, 'problem', error)})") from None
    except RecursionError:
        raise RunDirError(f"{path}: nested too deep to be a run's config") from None
    if not isinstance(config, dict):
        raise RunDirError(f"{path}: not a mapping of settings ({type(config).__name__})")
    header = {}
    for line in text.splitlines():
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        header[key] = value
    return header


def _regular_bytes(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (a FIFO would block the
    read, a directory or a device is no log)."""
    try:
        if not path.is_file():
            if path.is_symlink() and not path.exists():
                what = "a dangling or looping symlink"
            else:
                what = "missing" if not path.exists() else "not a regular file"
            raise RunDirError(f"{path}: {what}")
        size = path.stat().st_size
        if size > limit:
            raise RunDirError(f"{path}: {size} bytes, more than the {limit} a run writes")
        return path.read_bytes()
    except OSError as error:
        raise RunDirError(f"{path}: unreadable ({error.strerror or error})") from None


def _parse(raw: bytes) -> dict[str, Any]:
    """One line's record, checked; RunDirError (without the place: the caller adds it)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise RunDirError(f"not UTF-8 (byte {error.start})") from None
    except ValueError as error:
        raise RunDirError(f"not JSON ({error})") from None
    except RecursionError:
        raise RunDirError("nested too deep to be a metrics record") from None
    if not isinstance(record, dict):
        raise RunDirError(f"not a JSON object ({type(record).__name__})")
    step = record.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise RunDirError(f"step {_show(step)}: not an integer from 0 to {MAX_STEP}")
    for key in (*FRACTIONS, *COUNTS, *VALUES):
        _check_field(record, key)
    return record


def _check_field(record: dict[str, Any], key: str) -> None:
    if record.get(key) is None:
        if key == "acceptance_rate" and "reward_mean" in record:
            raise RunDirError(f"{key} {_show(record.get(key))}: a step line has a number there")
        if key == "reward_mean" and key in record:
            raise RunDirError(f"{key} null: a step line has a number there")
        return
    value = record[key]
    if key in MAY_BE_NAN and type(value) is float and math.isnan(value):
        return
    if type(value) not in (int, float) or not math.isfinite(value):
        raise RunDirError(f"{key} {_show(value)}: not a finite number")
    if key in FRACTIONS and not 0 <= value <= 1:
        raise RunDirError(f"{key} {_show(value)}: outside 0 to 1")
    if key in COUNTS and value < 0:
        raise RunDirError(f"{key} {_show(value)}: negative")


def _show(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} lines, steps {_show(steps[0])} to {_show(steps[-1])}"
