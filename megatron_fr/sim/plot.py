"""PNG figures of simulations: a sweep over cluster sizes, and the splits --suggest tried.

Drawn on a bare Figure with the Agg canvas (as analysis/plot.py), so importing this module
never switches the process-wide pyplot backend.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_fr.sim.result import SimResult
from megatron_fr.sim.sweep import Suggestion

STYLE = {"flash_reinforce": "-", "grpo_sync": "--"}
LABEL = {"flash_reinforce": "FlashREINFORCE (async)", "grpo_sync": "GRPO (sync)"}


def _by_scheme(results: list[SimResult]) -> dict[str, list[SimResult]]:
    groups: dict[str, list[SimResult]] = {}
    for result in results:
        groups.setdefault(result.scheme, []).append(result)
    return groups


def plot_sweep(results: list[SimResult], out: str | Path) -> Path:
    """Utilisation and trajectories/h against total nodes for each scheme, and the
    FlashREINFORCE lag histogram at each node count."""
    fig = Figure(figsize=(16, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    util, throughput, lags = fig.subplots(1, 3)
    for scheme, group in _by_scheme(results).items():
        nodes = [r.rollout_nodes + r.learner_nodes for r in group]
        style, label = STYLE.get(scheme, ":"), LABEL.get(scheme, scheme)
        util.plot(
            nodes,
            [r.rollout_util for r in group],
            style,
            marker="o",
            color="C0",
            label=f"rollout decode, {label}",
        )
        util.plot(
            nodes,
            [r.learner_util for r in group],
            style,
            marker="s",
            color="C1",
            label=f"learner, {label}",
        )
        throughput.plot(
            nodes, [r.trajectories_per_hour for r in group], style, marker="o", label=label
        )
    for index, result in enumerate(r for r in results if r.scheme == "flash_reinforce"):
        total = sum(result.lag_histogram.values())
        xs = sorted(result.lag_histogram)
        node_count = result.rollout_nodes + result.learner_nodes
        shares = [result.lag_histogram[x] / total for x in xs]
        lags.step(xs, shares, where="mid", color=f"C{index}", label=f"{node_count} nodes")
    totals = sorted({r.rollout_nodes + r.learner_nodes for r in results})
    for ax in (util, throughput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(totals, labels=[str(n) for n in totals])
        ax.set_xlabel("nodes (rollout + learner)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    util.set_title("GPU utilisation")
    util.set_ylim(0, 1.05)
    throughput.set_title("trained trajectories per hour")
    lags.set_title("FlashREINFORCE lag histogram")
    lags.set_xlabel("lag (versions)")
    lags.set_ylabel("share of trained trajectories")
    lags.grid(alpha=0.3)
    lags.legend(fontsize="small")
    return _save(fig, out)


def plot_suggestion(suggestion: Suggestion, out: str | Path) -> Path:
    """Trajectories/h, mean lag and drop share against the rollout nodes of each split."""
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    throughput, lag = fig.subplots(1, 2)
    results = suggestion.results
    rollout = [r.rollout_nodes for r in results]
    throughput.plot(rollout, [r.trajectories_per_hour for r in results], marker="o")
    lag.plot(rollout, [r.lag_mean for r in results], marker="o", label="lag mean")
    lag.plot(rollout, [100 * r.drop_share for r in results], marker="s", label="dropped (%)")
    for ax in (throughput, lag):
        ax.axvline(suggestion.chosen.rollout_nodes, color="grey", linestyle=":")
        ax.set_xlabel(f"rollout nodes (of {suggestion.total_nodes})")
        ax.grid(alpha=0.3)
    throughput.set_title("trained trajectories per hour")
    lag.set_title(f"lag and drops at max_lag {suggestion.target_lag}")
    lag.legend(fontsize="small")
    return _save(fig, out)


def _save(fig: Figure, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
