"""What a training run leaves in its run directory: per-step metrics, TensorBoard, config.

    run_dir/metrics.jsonl   one JSON object per line: a step line per optimizer step, an eval
                            line per evaluation (it carries `eval_accuracy`); the source of truth
    (sinks)                 the same numbers as TensorBoard scalars or a W&B run, keyed by
                            `step` (orchestrator/sinks.py, chosen by the run's `report`)
    run_dir/config.yaml     the fully resolved config of the run

Crash safety: every line is written with one write() and then flushed and fsync'ed, so a
SIGKILL loses at most the line being written. A run is resumed by reopening the logger on the
same directory; it first cuts off the remnant of such an interrupted line, so that the file
stays valid JSONL and new lines never get glued onto a fragment. Readers apply the same rule
(analysis/run_files.py, which names the files and reads them back): the last line may be a
remnant and is skipped; a bad line anywhere else is corruption and is reported with its line
number.

Only rank 0 writes: other ranks build the logger with `enabled=False`, which makes every
method a no-op, so call sites need no rank checks.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
from tqdm import tqdm

from megatron_fr.analysis.run_files import (
    CONFIG_FILE,
    METRICS_FILE,
    is_number,
    read_metrics,
    scan,
)
from megatron_fr.orchestrator.sinks import MetricSink

STEP_KEYS = (
    "step",
    "policy_version",
    "reward_mean",
    "acceptance_rate",
    "lag_mean",
    "lag_max",
    "tokens_per_s",
    "rollouts_total",
)
EVAL_KEYS = ("step", "rollouts_total", "eval_accuracy")
INCOMPLETE_EVAL_KEYS = ("step", "rollouts_total", "eval_incomplete")
"""An evaluation the pool could not serve: `eval_incomplete` 1 and `eval_accuracy` null."""

# Progress-bar postfix: label -> metric key, in display order.
_POSTFIX = (
    ("reward", "reward_mean"),
    ("accept", "acceptance_rate"),
    ("lag", "lag_mean"),
    ("lag_max", "lag_max"),
    ("eval_acc", "eval_accuracy"),
)


def _plain(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy with 0-d tensors / numpy scalars turned into Python numbers (JSON and TB want
    those, and the controller naturally hands over `loss.item()`-able values)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric keys must be strings, got {key!r}")
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (ValueError, RuntimeError) as err:
                raise TypeError(f"metric {key!r} is not a scalar: {err}") from err
        out[key] = value
    return out


def _check(metrics: Mapping[str, Any], required: tuple[str, ...], what: str) -> None:
    """ValueError naming the first required key that is missing or not a number."""
    for key in required:
        if key not in metrics:
            raise ValueError(
                f"{what}: required key {key!r} is missing (got {sorted(metrics)}; "
                f"required: {list(required)})"
            )
        if not is_number(metrics[key]):
            raise ValueError(f"{what}: {key!r} must be a number, got {metrics[key]!r}")
    if not isinstance(metrics["step"], int):
        raise ValueError(f"{what}: 'step' must be an int, got {metrics['step']!r}")


def last_step(run_dir: str | Path) -> int | None:
    """`step` of the last record, or None for a run that has logged nothing yet."""
    if not (Path(run_dir) / METRICS_FILE).exists():
        return None
    records = read_metrics(run_dir)
    return int(records[-1]["step"]) if records else None


def save_resolved_config(
    run_dir: str | Path, config: Mapping[str, Any], header: Mapping[str, object] | None = None
) -> Path:
    """Write run_dir/config.yaml, keys in the config's own order, atomically (a crash leaves
    the previous file or the new one, never half of one), `header` as comment lines above
    them (what the run started from; the file still loads as the config). Returns the path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    partial = run_dir / f".{CONFIG_FILE}.partial-{os.getpid()}"
    comments = "".join(f"# {key}: {value}\n" for key, value in (header or {}).items())
    text = comments + yaml.safe_dump(dict(config), sort_keys=False)
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)
    return path


def read_config_header(run_dir: str | Path) -> dict[str, str]:
    """The `# key: value` lines save_resolved_config wrote above run_dir/config.yaml (what
    the run started from: the model's hash, the commit); {} when the run has no config."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return {}
    header = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        header[key] = value
    return header


def _repair(path: Path) -> list[dict[str, Any]]:
    """Make an existing metrics file safe to append to; return its records.

    An interrupted last line is cut off; a complete last line that only lacks its newline
    (killed between the JSON and the newline) gets one."""
    records, intact = scan(path)
    with path.open("r+b") as file:
        file.truncate(intact)
        if intact:
            file.seek(intact - 1)
            if file.read(1) != b"\n":
                file.write(b"\n")
        file.flush()
        os.fsync(file.fileno())
    return records


class RunLogger:
    """Appends metrics to run_dir/metrics.jsonl, mirrors them to TensorBoard and a progress bar.

    Reopening on the directory of a killed run continues it: earlier lines are kept and the
    bar starts at the last logged step. The bar position is `step` itself, i.e. `step` counts
    the optimizer steps done.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        sinks: Sequence[MetricSink] = (),
        progress_total: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._closed = False
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / METRICS_FILE
        records = _repair(path) if path.exists() else []
        self._latest: dict[str, float] = {}
        for record in records:
            self._remember(record)
        self._file = path.open("a", encoding="utf-8")
        self._sinks = list(sinks)
        start = int(records[-1]["step"]) if records else 0
        self._bar = tqdm(
            total=progress_total,
            initial=start,
            desc=self.run_dir.resolve().name,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self._show()

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """One optimizer step; needs every key of STEP_KEYS, keeps any other key as given."""
        if not self.enabled:
            return
        metrics = _plain(metrics)
        _check(metrics, STEP_KEYS, "log_step")
        self._write(metrics, scope="train")
        self._bar.update(metrics["step"] - self._bar.n)
        self._show()

    def log_eval(self, metrics: Mapping[str, Any]) -> None:
        """One evaluation; needs EVAL_KEYS (`eval_accuracy_std`, the spread over eval seeds,
        is optional), or INCOMPLETE_EVAL_KEYS with `eval_accuracy` null. TensorBoard tags drop
        the `eval_` prefix: eval/accuracy, eval/accuracy_std."""
        if not self.enabled:
            return
        metrics = _plain(metrics)
        if metrics.get("eval_incomplete"):
            _check(metrics, INCOMPLETE_EVAL_KEYS, "log_eval")
            if metrics.get("eval_accuracy") is not None:
                raise ValueError("log_eval: an incomplete evaluation has no eval_accuracy")
        else:
            _check(metrics, EVAL_KEYS, "log_eval")
        self._write(metrics, scope="eval")
        self._show()

    def close(self) -> None:
        """Flush and close everything; safe to call twice."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        for sink in self._sinks:
            sink.close()
        self._bar.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _write(self, metrics: dict[str, Any], scope: str) -> None:
        if self._closed:
            raise RuntimeError(f"RunLogger for {self.run_dir} is closed")
        # Durable before the next line starts, so a kill can only ever cut the last line.
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        for sink in self._sinks:
            sink.write(scope, metrics)
        self._remember(metrics)

    def _remember(self, record: Mapping[str, Any]) -> None:
        for _, key in _POSTFIX:
            if is_number(record.get(key)):
                self._latest[key] = record[key]

    def _show(self) -> None:
        parts = [
            f"{label}={self._latest[key]:.3g}" for label, key in _POSTFIX if key in self._latest
        ]
        self._bar.set_postfix_str(" ".join(parts), refresh=False)
        # Steps are seconds apart: redraw on every call rather than on tqdm's own timer.
        self._bar.refresh()
