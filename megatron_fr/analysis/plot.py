"""`megatron-fr plot RUN_DIR [--out FILE]`: one PNG summarising a run's metrics.jsonl.

    python -m megatron_fr.analysis.plot runs/qwen3-0.6b-gsm8k     # same, before wiring

Top row against optimizer step, bottom row against generated rollouts (axes.PLOT_AXES):
reward, acceptance rate, policy lag (mean and max), eval accuracy with its spread over eval
seeds as a band. Both rows matter for async RL: a step can generate a varying number of
rollouts, so two runs are compared fairly on sample efficiency only along the bottom row.

Drawn on a bare Figure with the Agg canvas, so importing this module never switches the
process-wide pyplot backend.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_fr.analysis.axes import PLOT_AXES, X_AXES, logged_key
from megatron_fr.analysis.run_files import has_accuracy, read_metrics

PLOT_FILE = "metrics.png"

# (panel title, metric keys drawn in it)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean",)),
    ("acceptance rate", ("acceptance_rate",)),
    ("policy lag (versions)", ("lag_mean", "lag_max")),
    ("eval accuracy", ("eval_accuracy",)),
)
EPISODE_KEYS = ("turns_mean", "truncated_rate")
"""Text tasks' per-step figures, drawn in an "episodes" panel when the run logged them."""
TOOL_KEYS = ("tool_calls_mean", "tool_errors_mean", "tool_use_rate", "tool_success_rate")
"""Tool use per step (python_tool), drawn in a "tool use" panel: calls and failed calls per
trajectory, the share of trajectories with a call and the share of calls that ran."""
POOL_KEYS = ("engines_total", "engines_serving", "engines_out_total", "engine_seconds_lost")
"""The pool of engines (rollout/supervisor.py), drawn in an "engines" panel: how many there
are and serve, how many times one left, and the engine-seconds lost out of the pool."""
SYNC_CHECK_KEYS = ("sync_logprob_gap", "sync_logprob_gap_mean")
"""The check after each weight sync (weights/verify.py), drawn in a "sync check" panel: the
largest and the mean per-token gap between the engines' and the learner's log-probs."""


def _spread_key(key: str) -> str | None:
    """The key holding a metric's spread, drawn as a band: eval accuracies have one."""
    return f"{key}_std" if key.startswith("eval_") and key.endswith("_accuracy") else None


def panels_of(records: Sequence[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    """PANELS, with one accuracy line per named eval set, and the episodes, tool use, engines
    and sync check panels when the run has those figures."""
    sets = sorted({key for r in records for key in r if _spread_key(key)} - {"eval_accuracy"})
    panels = [*PANELS[:-1], ("eval accuracy", tuple(sets) or PANELS[-1][1])]
    optional = (
        ("episodes", EPISODE_KEYS),
        ("tool use", TOOL_KEYS),
        ("engines", POOL_KEYS),
        ("sync check", SYNC_CHECK_KEYS),
    )
    for title, keys in optional:
        logged = tuple(key for key in keys if any(key in r for r in records))
        panels += [(title, logged)] if logged else []
    return panels


def _series(
    records: Sequence[dict[str, Any]], x_key: str, y_key: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """x, y (and spread, NaN where absent) sorted by x, for records that carry both keys.

    A resumed run may log the same x again (from its last checkpoint on); the later record
    wins, so the curve shows the run that actually continued."""
    points: dict[float, tuple[float, float]] = {}
    spread_key = _spread_key(y_key)
    for record in records:
        x, y = record.get(x_key), record.get(y_key)
        if isinstance(x, int | float) and isinstance(y, int | float):
            points[x] = (y, record.get(spread_key, np.nan) if spread_key else np.nan)
    xs = np.array(sorted(points), dtype=float)
    ys = np.array([points[x][0] for x in sorted(points)], dtype=float)
    spread = np.array([points[x][1] for x in sorted(points)], dtype=float)
    return xs, ys, None if np.isnan(spread).all() else spread


def _draw_panel(
    ax: Axes, records: Sequence[dict[str, Any]], x_key: str, keys: tuple[str, ...]
) -> None:
    """The keys' curves; in the eval accuracy panel each incomplete evaluation (no accuracy:
    the pool did not serve it) is a dotted red line at its x, not a point at 0."""
    drawn = 0
    if any(_spread_key(key) for key in keys):
        incomplete = [r[x_key] for r in records if r.get("eval_incomplete") and x_key in r]
        for index, x in enumerate(incomplete):
            label = "incomplete eval" if index == 0 else None
            ax.axvline(x, color="tab:red", linestyle=":", label=label)
        drawn += len(incomplete)
    for key in keys:
        xs, ys, spread = _series(records, x_key, key)
        if not len(xs):
            continue
        drawn += 1
        sparse = len(xs) < 30  # evals are few: show each point
        ax.plot(xs, ys, marker="o" if sparse else None, markersize=3, label=key)
        if spread is not None:
            ax.fill_between(xs, ys - spread, ys + spread, alpha=0.25, label="± std over seeds")
    if not drawn:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    ax.grid(alpha=0.3)
    if len(ax.get_legend_handles_labels()[0]) > 1:
        ax.legend(fontsize="small")


def _title(run_dir: Path, records: Sequence[dict[str, Any]]) -> str:
    steps = [r["step"] for r in records if "reward_mean" in r]
    rollouts = [r["rollouts_total"] for r in records if "rollouts_total" in r]
    evals = [r for r in records if has_accuracy(r)]
    title = f"{run_dir.resolve().name}: {steps[-1] if steps else 0} steps"
    if rollouts:
        title += f", {max(rollouts):,} rollouts"
    if evals:
        title += f", eval accuracy {evals[-1]['eval_accuracy']:.3f} at step {evals[-1]['step']}"
    return title


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the run's figure to `out` (default run_dir/metrics.png) and return its path.

    FileNotFoundError naming the path when run_dir or its metrics.jsonl is missing."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    panels = panels_of(records)
    fig = Figure(figsize=(4 * len(panels), 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(PLOT_AXES), len(panels), squeeze=False)
    for row, axis in enumerate(PLOT_AXES):
        for col, (title, keys) in enumerate(panels):
            ax = axes[row][col]
            _draw_panel(ax, records, logged_key(axis), keys)
            ax.set_title(title)
            ax.set_xlabel(X_AXES[axis].label)
    fig.suptitle(_title(run_dir, records), fontsize="x-large")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with metrics.jsonl")
    parser.add_argument("--out", metavar="FILE", help="PNG to write (default RUN_DIR/metrics.png)")


def main(args: argparse.Namespace) -> int:
    """Exit code 0 after printing the path written; 2 (with the reason on stderr) when the run
    directory has no readable metrics."""
    try:
        path = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"megatron-fr plot: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="megatron-fr plot", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
