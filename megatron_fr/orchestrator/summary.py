"""The block `megatron-fr train` ends with: how the run went, where it is, what to run next.

Built from the run directory's metrics.jsonl alone (read by analysis/run_files.py), the file
every other reader of a run trusts, so the block says what the record says, and a run resumed
after a kill is summed over all its steps, not over this start's:

    steps trained       a count of step lines (each step is logged once, resumes included)
    rollouts            generated: the last line's rollouts_total; trained: the sum of the
                        step lines' batch_rollouts; dropped as stale: the last dropped_total
                        (discarded and abandoned ones named when there are any)
    held-out accuracy   the first and the last evaluation with an accuracy (± its spread over
                        the eval passes where the line has one), per eval set when several
    time per step       the mean of step_s (waiting for the batch, the step and the weight
                        sync; evaluations and checkpoints are not in it)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_fr.analysis.run_files import has_accuracy, read_metrics
from megatron_fr.orchestrator.sinks import TENSORBOARD_DIR

LABEL_WIDTH = 19


def run_summary(run_dir: str | Path, steps: int | None = None, tensorboard: bool = True) -> str:
    """The summary block of the run in `run_dir`; `steps`: the steps the recipe asked for;
    `tensorboard`: whether the run wrote TensorBoard scalars (the next command then names
    them)."""
    records = read_metrics(run_dir)
    step_lines = [r for r in records if "eval_incomplete" not in r and "eval_accuracy" not in r]
    rows = [("steps trained", _steps(step_lines, steps))]
    if step_lines:
        rows.append(("rollouts", _rollouts(step_lines)))
    rows += _accuracy_rows([r for r in records if has_accuracy(r)])
    step_s = [r["step_s"] for r in step_lines if isinstance(r.get("step_s"), (int, float))]
    if step_s:
        rows.append(("time per step", f"{statistics.fmean(step_s):.1f} s (mean of {len(step_s)})"))
    rows.append(("run directory", str(run_dir)))
    rows.append(("next", _next_commands(str(run_dir), tensorboard)))
    body = [
        f"{label:<{LABEL_WIDTH}}{line}" if index == 0 else f"{'':<{LABEL_WIDTH}}{line}"
        for label, text in rows
        for index, line in enumerate(text.splitlines())
    ]
    return "\n".join(["-- run summary " + "-" * 50, *body])


def _steps(step_lines: Sequence[Mapping[str, Any]], planned: int | None) -> str:
    done = len({r["step"] for r in step_lines})
    return f"{done}" if planned is None else f"{done} of {planned}"


def _rollouts(step_lines: Sequence[Mapping[str, Any]]) -> str:
    last = step_lines[-1]
    parts = [f"{last['rollouts_total']:,} generated"]
    if all("batch_rollouts" in r for r in step_lines):
        parts.append(f"{sum(r['batch_rollouts'] for r in step_lines):,} trained")
    parts.append(f"{last.get('dropped_total', 0):,} dropped as stale")
    for key, name in (("discarded_total", "discarded"), ("abandoned_total", "abandoned")):
        if last.get(key):
            parts.append(f"{last[key]:,} {name}")
    return ", ".join(parts)


def _accuracy_rows(evaluations: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """One row for the mean over the eval sets; one per set below it when there are several."""
    if not evaluations:
        return [("held-out accuracy", "no evaluation with an accuracy")]
    first, last = evaluations[0], evaluations[-1]
    sets = sorted(
        key.removeprefix("eval_").removesuffix("_accuracy")
        for key in last
        if key.startswith("eval_") and key.endswith("_accuracy") and key != "eval_accuracy"
    )
    keys = [("held-out accuracy", "eval_accuracy")]
    if len(sets) > 1:
        keys += [(f"  {name}", f"eval_{name}_accuracy") for name in sets]
    return [
        (label, f"{_accuracy(first, key)} (step {first['step']}) -> "
         f"{_accuracy(last, key)} (step {last['step']})")
        for label, key in keys
    ]  # fmt: skip


def _accuracy(record: Mapping[str, Any], key: str) -> str:
    value = record.get(key)
    if not isinstance(value, (int, float)):
        return "n/a"
    spread = record.get(f"{key}_std")
    return f"{value:.3f}" + (f" ± {spread:.3f}" if isinstance(spread, (int, float)) else "")


def _next_commands(run_dir: str, tensorboard: bool) -> str:
    commands = [
        f"megatron-fr plot {run_dir}",
        f"megatron-fr lengths {run_dir}",
    ]
    if tensorboard:
        commands.append(f"tensorboard --logdir {Path(run_dir) / TENSORBOARD_DIR}")
    return "\n".join(commands)
