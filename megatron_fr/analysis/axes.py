"""The x-axes a run's curves are drawn and read against, each defined once: the run plot draws
a row against each of PLOT_AXES (analysis/plot.py), a comparison reads its results against one
of BUDGETS (`compare --x`, analysis/compare_report.py).

    step        optimizer steps: each metrics line's `step`
    trained     trained rollouts: step x the batch size B (what each method learned from)
    generated   generated rollouts: each line's `rollouts_total` (what the engines spent,
                including a group estimator's discarded groups and the drops of stale
                trajectories)
    tokens      trained response tokens: the response tokens of the trained batches, summed
                over the step lines (response_length_mean x B)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XAxis:
    label: str
    """What the axis is called on a figure and in a table's header."""
    key: str | None = None
    """The metrics key that holds the value on each line; None where it is computed from
    other keys and the batch size."""


X_AXES: dict[str, XAxis] = {
    "step": XAxis("optimizer step", "step"),
    "trained": XAxis("trained rollouts"),
    "generated": XAxis("generated rollouts", "rollouts_total"),
    "tokens": XAxis("trained response tokens"),
}
BUDGETS = ("trained", "generated", "tokens")
"""The axes a comparison is read against: budgets of rollouts or tokens (runs of one batch
size train the same rollouts per step, so steps are no budget of their own)."""
PLOT_AXES = ("step", "generated")
"""The run plot's rows: a step can generate a varying number of rollouts, so two runs are
compared fairly on sample efficiency only along the second."""


def logged_key(name: str) -> str:
    """The metrics key axis `name` is read off each line from; ValueError for an axis computed
    from other keys (trained, tokens)."""
    key = X_AXES[name].key
    if key is None:
        raise ValueError(f"the {name} axis is computed from the step lines, not logged")
    return key
