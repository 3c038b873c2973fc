"""The statistics of a comparison: mean accuracy curves over seeds, where a curve crosses a
target, and bootstrap confidence intervals over seeds.

    curve      (trained rollouts, accuracy) at each evaluation of one run
    crossing   the rollouts at which a mean curve first reaches the target, linearly
               interpolated between the two evaluations around it (None: never reached)
    interval   the 2.5 / 97.5 percentiles of a statistic over resamples of the seeds (each
               configuration's seeds drawn with replacement, independently), a percentile
               bootstrap: it needs no normality, and with few seeds it is as wide as the
               seeds' spread makes it
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

Curve = list[tuple[int, float]]

RESAMPLES = 2000


def mean_curve(curves: Sequence[Curve]) -> list[tuple[int, float, float]]:
    """(rollouts, mean, population std over seeds) at the evaluation points all seeds share."""
    shared = set.intersection(*({x for x, _ in curve} for curve in curves))
    out = []
    for x in sorted(shared):
        values = [dict(curve)[x] for curve in curves]
        out.append((x, statistics.fmean(values), statistics.pstdev(values)))
    return out


def crossing(curve: Sequence[tuple[int, float, float]], target: float) -> float | None:
    """Rollouts at which the mean first reaches `target`, interpolated linearly between the
    evaluation below it and the one that reaches it; None if it never does."""
    previous = None
    for x, mean, _ in curve:
        if mean >= target:
            if previous is None:
                return float(x)
            (x0, y0) = previous
            return x0 + (target - y0) / (mean - y0) * (x - x0)
        previous = (x, mean)
    return None


def bootstrap_interval(
    groups: Sequence[Sequence[Curve]],
    statistic: Callable[..., float | None],
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> tuple[float, float] | None:
    """The 95% percentile interval of statistic(*resampled groups) over `resamples` draws,
    each group's seeds resampled with replacement; None results (a target never reached)
    count as +inf. None when fewer than 2 seeds leave nothing to resample."""
    if min(len(group) for group in groups) < 2:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        drawn = [[rng.choice(group) for _ in group] for group in groups]
        value = statistic(*drawn)
        values.append(float("inf") if value is None else value)
    values.sort()
    return values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]


def final_accuracy(curves: Sequence[Curve]) -> float:
    return mean_curve(curves)[-1][1]


def budget_ratio(curves: Sequence[Curve], reference: Sequence[Curve]) -> float | None:
    """Rollouts `curves` need to reach the reference's final mean accuracy, over the
    reference's whole budget (its last evaluation)."""
    ref = mean_curve(reference)
    reach = crossing(mean_curve(curves), ref[-1][1])
    return None if reach is None else reach / ref[-1][0]
