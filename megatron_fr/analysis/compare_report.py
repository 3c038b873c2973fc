"""What a comparison reports: each run read into a summary, then the tables of results.md and
the accuracy figure (the statistics themselves are compare_stats.py's).

The budget on the x-axis is one of axes.BUDGETS: trained rollouts (steps x B: what each
method learned from), generated rollouts (rollouts_total at each evaluation: what the engines
spent, including a group estimator's discarded groups and the drops of stale trajectories) or
trained tokens (the response tokens of the trained batches)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from megatron_fr.analysis import compare_stats as stats
from megatron_fr.analysis.axes import X_AXES, logged_key
from megatron_fr.analysis.compare_reader import read_records
from megatron_fr.analysis.run_files import has_accuracy

TOOL_FIGURES = ("tool_calls_mean", "tool_use_rate", "tool_success_rate")
"""The step figures a tool-use comparison reads (rollout/episodes.py episode_metrics)."""
TOOL_WINDOW = 10
"""Steps averaged at the start and at the end of a run for its tool use."""
STOPPED_CALLING = 0.05
"""A run whose last steps call the tool in fewer trajectories than this has stopped."""


@dataclass(frozen=True)
class RunSummary:
    variant: str
    seed: int
    curve: stats.Curve
    """(trained rollouts, held-out accuracy) at each evaluation."""
    acceptance: float
    kl: float | None
    lag: float | None
    """Mean over steps of the batch's mean lag (versions between its oldest token and the
    learner)."""
    curves: dict[str, stats.Curve] = field(default_factory=dict)
    """The same evaluations against each other budget of axes.BUDGETS."""
    lr: float | None = None
    """The learning rate the run trained at (None: the recipe's)."""
    tool_use: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Tool-using tasks: each of TOOL_FIGURES as (mean over the first, over the last
    TOOL_WINDOW steps); empty where the run logged none."""

    def on(self, axis: str) -> stats.Curve:
        return self.curve if axis == "trained" else self.curves[axis]


def summarise(
    variant: str,
    seed: int,
    run_dir: Path,
    batch_size: int,
    lr: float | None = None,
    records: list[dict] | None = None,
) -> RunSummary:
    """The run's summary from its metrics records (`records`, as compare_reader checked them,
    or read from `run_dir` through the same reader: a malformed line is a RunDirError naming
    its file and line, never an exception from inside the summary)."""
    if records is None:
        records = read_records(run_dir)
    evals = [r for r in records if has_accuracy(r)]
    steps = [r for r in records if "reward_mean" in r]
    kls = [r["sequence_kl_mean"] for r in steps if _finite(r.get("sequence_kl_mean"))]
    lags = [r["lag_mean"] for r in steps if r.get("lag_mean") is not None]
    tokens_by_step, total = {0: 0.0}, 0.0
    for record in steps:
        total += record.get("response_length_mean", 0.0) * batch_size
        tokens_by_step[record["step"]] = total
    trained = sorted({r["step"]: r["eval_accuracy"] for r in evals}.items())
    generated = {r["step"]: r.get(logged_key("generated"), 0) for r in evals}
    return RunSummary(
        variant,
        seed,
        curve=[(step * batch_size, accuracy) for step, accuracy in trained],
        acceptance=statistics.fmean(r["acceptance_rate"] for r in steps) if steps else 0.0,
        kl=statistics.fmean(kls) if kls else None,
        lag=statistics.fmean(lags) if lags else None,
        curves={
            "generated": [(generated[step], accuracy) for step, accuracy in trained],
            "tokens": [(tokens_by_step.get(step, total), accuracy) for step, accuracy in trained],
        },
        lr=lr,
        tool_use=_tool_use(steps),
    )


def _tool_use(steps: list[dict]) -> dict[str, tuple[float, float]]:
    """TOOL_FIGURES over the first and the last TOOL_WINDOW steps that logged each; empty
    for a run that never called a tool (a text task without one logs 0 calls a step)."""
    if not any(_finite(r.get("tool_calls_mean")) and r["tool_calls_mean"] > 0 for r in steps):
        return {}
    windows = {}
    for key in TOOL_FIGURES:
        values = [r[key] for r in steps if _finite(r.get(key))]
        if values:
            first, last = values[:TOOL_WINDOW], values[-TOOL_WINDOW:]
            windows[key] = (statistics.fmean(first), statistics.fmean(last))
    return windows


def tool_table(by_variant: dict[str, list[RunSummary]]) -> str:
    """Tool use at the start and the end of the runs, per configuration (mean over seeds),
    and how many of its runs stopped calling the tool; empty when no run used one."""
    if not any(run.tool_use for runs in by_variant.values() for run in runs):
        return ""
    labels = ("tool calls per trajectory", "trajectories with a call", "calls that ran")
    header = "| run | " + " | ".join(
        f"{label}: first -> last {TOOL_WINDOW} steps" for label in labels
    )
    lines = [header + " | runs that stopped calling |", "|" + "---|" * (len(labels) + 2)]
    for name, runs in by_variant.items():
        cells = []
        for key in TOOL_FIGURES:
            pairs = [run.tool_use[key] for run in runs if key in run.tool_use]
            if not pairs:
                cells.append("-")
                continue
            first, last = (statistics.fmean(window) for window in zip(*pairs, strict=True))
            cells.append(f"{first:.2f} -> {last:.2f}")
        use = [run.tool_use.get("tool_use_rate", (0.0, 0.0))[1] for run in runs]
        stopped = sum(rate < STOPPED_CALLING for rate in use)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {stopped} of {len(runs)} |")
    return "\n".join(lines) + "\n"


def _finite(value: object) -> bool:
    """A measurement to average: a skipped step's NaN KL is none."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def results_table(
    by_variant: dict[str, list[RunSummary]], reference: str | None, axis: str = "trained"
) -> str:
    """One row per configuration: its learning rate, seeds, final accuracy (mean +- sample std,
    and the t interval of the mean), mean accuracy over the budget (bootstrap interval), mean
    acceptance, KL and lag; with a reference, the budget each needs to reach the reference's
    final accuracy on the isotonic fits, as a share of the reference's budget (paired
    bootstrap interval when the seeds match)."""
    curves = {name: [run.on(axis) for run in runs] for name, runs in by_variant.items()}
    header = (
        "| run | lr | seeds | final accuracy (mean +- sample std) | 95% t interval "
        "| mean accuracy over the budget (95% bootstrap) | mean acceptance | mean KL | mean lag |"
    )
    if reference:
        budget = X_AXES[axis].label
        header += f" {budget} to reach {reference}'s final (x its budget, 95% interval) |"
    lines = [header, "|" + "---|" * (9 + bool(reference))]
    for name, runs in by_variant.items():
        finals = [curve[-1][1] for curve in curves[name]]
        area = stats.area_under_curve(curves[name])
        area_interval = stats.bootstrap_interval([curves[name]], stats.area_under_curve)
        lr = runs[0].lr
        row = (
            f"| {name} | {'recipe' if lr is None else f'{lr:g}'} | {len(runs)} "
            f"| {statistics.fmean(finals):.3f} +- {stats.sample_std(finals):.3f} "
            f"| {_interval(stats.t_interval(finals))} "
            f"| {area:.3f} {_interval(area_interval)} "
            f"| {statistics.fmean(r.acceptance for r in runs):.3f} "
            f"| {_mean_or_na([r.kl for r in runs], '{:.2e}')} "
            f"| {_mean_or_na([r.lag for r in runs], '{:.2f}')} |"
        )
        if reference:
            row += f" {_reach(curves[name], curves[reference])} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def gap_table(by_variant: dict[str, list[RunSummary]], reference: str, axis: str) -> str:
    """Accuracy minus the reference's at each budget both evaluated, with its 95% bootstrap
    interval (paired by seed when both have the same seeds)."""
    curves = {name: [run.on(axis) for run in runs] for name, runs in by_variant.items()}
    others = [name for name in curves if name != reference]
    rows: dict[float, list[str]] = {}
    for name in others:
        for x, gap, interval in stats.gap_at_each_budget(curves[name], curves[reference]):
            rows.setdefault(x, []).append(f"{gap:+.3f} {_interval(interval)}")
    header = f"| {X_AXES[axis].label} | " + " | ".join(f"{n} - {reference}" for n in others) + " |"
    lines = [header, "|" + "---|" * (1 + len(others))]
    lines += [f"| {x:,.0f} | " + " | ".join(cells) + " |" for x, cells in sorted(rows.items())]
    return "\n".join(lines) + "\n"


def sweep_table(
    scores: dict[str, dict[float, float]],
    chosen: dict[str, float],
    edges: dict[str, str] | None = None,
) -> str:
    """The learning-rate sweep: each configuration's selection score on the selection seeds
    at each learning rate, and the one chosen (marked where it is the grid's `edges`)."""
    edges = edges or {}
    lrs = sorted({lr for by_lr in scores.values() for lr in by_lr})
    header = "| run | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | chosen |"
    lines = [header, "|" + "---|" * (2 + len(lrs))]
    for name, by_lr in scores.items():
        cells = [f"{by_lr[lr]:.3f}" if lr in by_lr else "-" for lr in lrs]
        edge = f" (the grid's {edges[name]}: widen it)" if name in edges else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen[name]:g}{edge} |")
    return "\n".join(lines) + "\n"


def _reach(curves: list, reference: list) -> str:
    ratio = stats.budget_ratio(curves, reference)
    if ratio is None:
        return "not reached"
    budget = stats.mean_curve(reference)[-1][0]
    paired = len(curves) == len(reference)
    interval = stats.bootstrap_interval([curves, reference], stats.budget_ratio, paired=paired)
    return f"{ratio * budget:,.0f} ({ratio:.2f}x, {_interval(interval, 'x')})"


def _interval(bounds: tuple[float, float] | None, unit: str = "") -> str:
    if bounds is None:
        return "n/a (1 seed)"
    low, high = (f"{b:.3f}{unit}" if b != float("inf") else "not reached" for b in bounds)
    return f"[{low}, {high}]"


def _mean_or_na(values: list[float | None], form: str) -> str:
    present = [v for v in values if v is not None]
    return form.format(statistics.fmean(present)) if present else "n/a"


def plot(by_variant: dict[str, list[RunSummary]], out: Path, title: str, axis: str) -> None:
    """Each configuration's mean accuracy against the budget, the sample std as a band, and
    its isotonic fit dashed (the curve the crossings are read from)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, runs in by_variant.items():
        curves = [run.on(axis) for run in runs]
        curve = stats.mean_curve(curves)
        xs = [x for x, _, _ in curve]
        means = [m for _, m, _ in curve]
        stds = [s for _, _, s in curve]
        (line,) = axes.plot(xs, means, marker="o", label=f"{name} ({len(runs)} seeds)")
        axes.plot(xs, [y for _, y in stats.smoothed_curve(curves)], "--", color=line.get_color())
        axes.fill_between(
            xs,
            [m - s for m, s in zip(means, stds, strict=True)],
            [m + s for m, s in zip(means, stds, strict=True)],
            alpha=0.2,
            color=line.get_color(),
        )
    axes.set_xlabel(X_AXES[axis].label)
    axes.set_ylabel("held-out accuracy (dashed: isotonic fit)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
