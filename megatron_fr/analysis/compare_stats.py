"""The statistics of a comparison, as a careful reviewer would compute them from a few seeds.

curve       (budget, accuracy) at each evaluation of one run; the budget is trained
            rollouts, generated rollouts or trained tokens (axes.BUDGETS)
alignment   runs evaluated at the same step have the same trained rollouts, but not the same
            generated rollouts or tokens; such curves are each interpolated linearly onto one
            grid before any mean is taken (aligned)
spread      the sample standard deviation over seeds (n - 1 in the denominator: the
            population's, n, understates it by 12 % at 5 seeds and 22 % at 3)
t interval  mean +- t(0.975, n - 1) * s / sqrt(n): the 95 % interval of a mean from n seeds
            under normality (t_quantile computes Student's quantile itself)
bootstrap   the 2.5 / 97.5 percentiles of a statistic over resamples of the seeds; a paired
            bootstrap draws the same seed indices for every configuration (a seed fixes the
            prompt order and the start, so configurations of one seed are compared whole)
area        the mean accuracy over the budget: the trapezoid area under the mean curve over
            its width, one number for a whole curve that a single noisy evaluation cannot
            swing the way a final accuracy can
crossing    the budget at which a curve first reaches a target, on the isotonic (monotone
            least-squares) fit of the mean curve, linearly interpolated: a noisy,
            non-monotone mean can touch a target once by chance; its fit cannot
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Sequence

Curve = list[tuple[float, float]]

RESAMPLES = 2000


def aligned(curves: Sequence[Curve]) -> list[Curve]:
    """The curves at budgets they share. Curves that share two or more evaluation budgets
    (trained rollouts: the same steps) keep those points. Otherwise (generated rollouts,
    tokens: each run spends its own by a given step) each is interpolated linearly at one grid:
    its k-th point the mean over the curves of their k-th evaluation's budget (as many points as
    evaluations, each near where the runs evaluated), kept within the budgets every curve
    covers. ValueError if they cover none in common."""
    shared = set.intersection(*({x for x, _ in curve} for curve in curves))
    if len(shared) >= 2 or all(len(curve) == len(shared) for curve in curves):
        return [[(x, y) for x, y in curve if x in shared] for curve in curves]
    budgets = [[x for x, _ in curve] for curve in curves]
    low, high = max(b[0] for b in budgets), min(b[-1] for b in budgets)
    if low > high:
        raise ValueError(f"the runs' budgets do not overlap (from {low:g} to {high:g})")
    depth = min(len(b) for b in budgets)
    means = (statistics.fmean(b[k] for b in budgets) for k in range(depth))
    grid = sorted({min(max(x, low), high) for x in means})
    return [[(x, _interpolate(curve, x)) for x in grid] for curve in curves]


def _interpolate(curve: Curve, x: float) -> float:
    """The curve's accuracy at budget x, linear between the evaluations around it."""
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    if len(curve) == 1 and curve[0][0] == x:
        return curve[0][1]
    raise ValueError(f"budget {x:g} is outside the curve ({curve[0][0]:g} to {curve[-1][0]:g})")


def mean_curve(curves: Sequence[Curve]) -> list[tuple[float, float, float]]:
    """(budget, mean, sample std over seeds) at the evaluation points all seeds share, after
    aligning them (aligned)."""
    curves = aligned(curves)
    out = []
    for index, (x, _) in enumerate(curves[0]):
        values = [curve[index][1] for curve in curves]
        out.append((x, statistics.fmean(values), sample_std(values)))
    return out


def sample_std(values: Sequence[float]) -> float:
    """The sample standard deviation (n - 1); 0 for a single value, which has no spread to
    estimate (tables say so by their n)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def t_quantile(probability: float, freedom: int) -> float:
    """Student's t quantile with `freedom` degrees of freedom, by bisection on its CDF, which is
    1/2 plus Simpson's integral of the density from 0 (accurate to ~1e-7 for p <= 0.9995)."""
    if not 0.5 <= probability < 1 or freedom < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and freedom >= 1, got {probability}")
    scale = math.exp(math.lgamma((freedom + 1) / 2) - math.lgamma(freedom / 2)) / math.sqrt(
        freedom * math.pi
    )

    def cdf(t: float, intervals: int = 4000) -> float:
        h = t / intervals
        total = 0.0
        for i in range(intervals + 1):
            weight = 1 if i in (0, intervals) else (4 if i % 2 else 2)
            total += weight * (1 + (i * h) ** 2 / freedom) ** (-(freedom + 1) / 2)
        return 0.5 + scale * total * h / 3

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        low, high = high, 2 * high
    while high - low > 1e-9:
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < probability else (low, middle)
    return (low + high) / 2


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """The `level` interval of the mean of `values` (module docstring); None below 2 values."""
    if len(values) < 2:
        return None
    half = t_quantile(0.5 + level / 2, len(values) - 1) * sample_std(values)
    half /= math.sqrt(len(values))
    mean = statistics.fmean(values)
    return mean - half, mean + half


def bootstrap_interval(
    groups: Sequence[Sequence[Curve]],
    statistic: Callable[..., float | None],
    seed: int = 0,
    resamples: int = RESAMPLES,
    paired: bool = False,
) -> tuple[float, float] | None:
    """The 95% percentile interval of statistic(*resampled groups) over `resamples` draws:
    each group's seeds resampled with replacement, independently, or with the same indices for
    every group when `paired` (groups of equal size, seed i of each from the same seed). None
    results (a target never reached) count as +inf. None when fewer than 2 seeds leave
    nothing to resample."""
    if min(len(group) for group in groups) < 2:
        return None
    if paired and len({len(group) for group in groups}) > 1:
        raise ValueError("a paired bootstrap needs the same seeds in every group")
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(len(groups[0])) for _ in groups[0]]
            drawn = [[group[i] for i in picks] for group in groups]
        else:
            drawn = [[rng.choice(group) for _ in group] for group in groups]
        value = statistic(*drawn)
        values.append(float("inf") if value is None else value)
    values.sort()
    return values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]


def final_accuracy(curves: Sequence[Curve]) -> float:
    return mean_curve(curves)[-1][1]


def area_under_curve(curves: Sequence[Curve]) -> float:
    """Mean accuracy over the budget (module docstring): the trapezoid area under the mean
    curve divided by its width (the one value itself for a single evaluation)."""
    curve = mean_curve(curves)
    if len(curve) == 1:
        return curve[0][1]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0, _), (x1, y1, _) in itertools.pairwise(curve))
    return area / (curve[-1][0] - curve[0][0])


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent
    violators, equal weights): each run of violators replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled block
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def smoothed_curve(curves: Sequence[Curve]) -> list[tuple[float, float]]:
    """(budget, isotonic fit of the mean accuracy) at the shared evaluations."""
    curve = mean_curve(curves)
    fit = isotonic([mean for _, mean, _ in curve])
    return [(x, y) for (x, _, _), y in zip(curve, fit, strict=True)]


def crossing(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """Budget at which `curve` first reaches `target`, interpolated linearly between the
    evaluation below it and the one that reaches it; None if it never does."""
    previous = None
    for x, y in curve:
        if y >= target:
            if previous is None:
                return float(x)
            (x0, y0) = previous
            return x0 + (target - y0) / (y - y0) * (x - x0)
        previous = (x, y)
    return None


def budget_ratio(curves: Sequence[Curve], reference: Sequence[Curve]) -> float | None:
    """The budget `curves` need to reach the reference's final accuracy, over the reference's
    whole budget, both on their isotonic fits (the reference's target is its fit's end, not
    its last noisy evaluation)."""
    ref = smoothed_curve(reference)
    reach = crossing(smoothed_curve(curves), ref[-1][1])
    return None if reach is None else reach / ref[-1][0]


def gap_at_each_budget(
    curves: Sequence[Curve], reference: Sequence[Curve]
) -> list[tuple[float, float, tuple[float, float] | None]]:
    """(budget, mean accuracy minus the reference's, its paired 95% bootstrap interval) at each
    evaluation both have (paired, seed i of both from the same seed, when both have as many
    seeds)."""
    out = []
    paired = len(curves) == len(reference)
    both = aligned([*curves, *reference])  # one grid for both (budgets differ by method)
    curves, reference = both[: len(curves)], both[len(curves) :]
    for x, _ in both[0]:

        def gap(ours: Sequence[Curve], theirs: Sequence[Curve], at: float = x) -> float:
            return _mean_at(ours, at) - _mean_at(theirs, at)

        interval = bootstrap_interval([curves, reference], gap, paired=paired)
        out.append((x, gap(curves, reference), interval))
    return out


def _mean_at(curves: Sequence[Curve], x: float) -> float:
    return statistics.fmean(dict(curve)[x] for curve in curves)
