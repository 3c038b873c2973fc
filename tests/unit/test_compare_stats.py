"""The statistics of `megatron-fr compare` (analysis/compare_stats.py) against values written
out here: Student's t quantiles from printed tables, the sample standard deviation and the t
interval by their formulas, the isotonic fit and the area under a curve by hand, a crossing
that a noisy mean touches by chance but its fit does not, and a paired bootstrap that sees a
constant gap where an unpaired one sees the seeds' spread. Then the learning-rate sweep's
choice, with the runs stood in for."""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import pytest

from megatron_fr.analysis import compare
from megatron_fr.analysis import compare_stats as stats
from megatron_fr.analysis.compare_report import RunSummary, sweep_table

STUDENT_T = {  # (p, degrees of freedom): quantile, from printed t tables
    (0.975, 1): 12.706205,
    (0.975, 2): 4.302653,
    (0.975, 4): 2.776445,
    (0.975, 7): 2.364624,
    (0.975, 30): 2.042272,
    (0.995, 10): 3.169273,
    (0.95, 5): 2.015048,
}


@pytest.mark.parametrize(("p", "freedom"), list(STUDENT_T))
def test_t_quantiles_equal_the_printed_tables(p: float, freedom: int) -> None:
    assert stats.t_quantile(p, freedom) == pytest.approx(STUDENT_T[p, freedom], abs=2e-6)


def test_sample_std_and_t_interval_by_their_formulas() -> None:
    values = [0.52, 0.61, 0.48, 0.70, 0.55, 0.66, 0.59, 0.50]
    n, mean = len(values), sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    assert stats.sample_std(values) == pytest.approx(std)
    assert stats.sample_std(values) > statistics.pstdev(values)  # the population's is smaller
    half = 2.364624 * std / math.sqrt(n)  # t(0.975, 7)
    assert stats.t_interval(values) == pytest.approx((mean - half, mean + half), abs=1e-6)
    assert stats.t_interval([0.5]) is None and stats.sample_std([0.5]) == 0.0


def test_isotonic_fit_pools_the_violators() -> None:
    assert stats.isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]
    assert stats.isotonic([3, 2, 1]) == [2, 2, 2]
    assert stats.isotonic([0.1, 0.5, 0.2, 0.3, 0.9]) == pytest.approx(
        [0.1, 1 / 3, 1 / 3, 1 / 3, 0.9]
    )
    assert stats.isotonic([]) == []


def test_area_under_the_curve_is_the_mean_accuracy_over_the_budget() -> None:
    curves = [[(0, 0.0), (10, 1.0), (20, 1.0)], [(0, 0.0), (10, 0.0), (20, 1.0)]]
    # mean curve 0, 0.5, 1: trapezoids 10 x 0.25 + 10 x 0.75 over a width of 20
    assert stats.area_under_curve(curves) == pytest.approx(0.5)
    assert stats.area_under_curve([[(5, 0.3)]]) == 0.3


def test_a_crossing_is_read_from_the_isotonic_fit_not_a_lucky_evaluation() -> None:
    noisy = [[(0, 0.2), (10, 0.5), (20, 0.3), (30, 0.6)]]
    raw = [(x, mean) for x, mean, _ in stats.mean_curve(noisy)]
    assert stats.crossing(raw, 0.45) == pytest.approx(0 + 0.25 / 0.3 * 10)  # touched by chance
    # fit: 0.2, 0.4, 0.4, 0.6; it reaches 0.45 between 20 (0.4) and 30 (0.6)
    assert stats.crossing(stats.smoothed_curve(noisy), 0.45) == pytest.approx(22.5)
    assert stats.crossing(stats.smoothed_curve(noisy), 0.7) is None
    reference = [[(0, 0.2), (30, 0.5), (60, 0.45)]]  # its target: its fit's end, 0.475
    assert stats.budget_ratio(noisy, reference) == pytest.approx((20 + 0.075 / 0.2 * 10) / 60)


def test_a_paired_bootstrap_sees_a_constant_gap_the_unpaired_one_blurs() -> None:
    base = [0.2, 0.5, 0.35, 0.7, 0.4]  # seeds of very different difficulty
    reference = [[(0, 0.0), (10, b)] for b in base]
    method = [[(0, 0.0), (10, b + 0.1)] for b in base]  # 0.1 better on every seed
    ((_, zero, _), (x, gap, paired)) = stats.gap_at_each_budget(method, reference)
    assert zero == 0 and x == 10 and gap == pytest.approx(0.1)
    assert paired == pytest.approx((0.1, 0.1))

    def difference(ours, theirs):
        return stats.final_accuracy(ours) - stats.final_accuracy(theirs)

    unpaired = stats.bootstrap_interval([method, reference], difference)
    assert unpaired[0] < 0 < 0.1 < unpaired[1]  # the seeds' spread swamps the gap
    with pytest.raises(ValueError, match="same seeds"):
        stats.bootstrap_interval([method, reference[:3]], difference, paired=True)


class SweepRuns:
    """Stands in for compare.Runs: a run's final accuracy is a function of its lr alone."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def summaries(self, planned):
        return [self.summary(run.variant, run.name, run.seed, run.lr) for run in planned]

    def summary(self, variant, name, seed, lr):
        self.names.append(name)
        accuracy = {1e-4: 0.3, 3e-4: 0.5, 1e-3: 0.4}[lr] + (0.2 if variant.name == "b" else 0)
        if variant.name == "b" and lr == 1e-3:
            accuracy += 0.2  # b's best is 1e-3, a's 3e-4
        return RunSummary(variant.name, seed, [(0, 0.0), (10, accuracy)], 1.0, None, None, lr=lr)


def test_each_configuration_gets_its_best_learning_rate_on_separate_seeds() -> None:
    runs = SweepRuns()
    variants = [compare.Variant("a", ()), compare.Variant("b", ())]
    lrs = (1e-4, 3e-4, 1e-3)
    by_mean = compare.SELECT_BY["mean"]
    scores, chosen = compare.choose_learning_rates(runs, variants, lrs, 2, by_mean)  # type: ignore[arg-type]
    assert chosen == {"a": 3e-4, "b": 1e-3}
    assert scores["a"] == pytest.approx({1e-4: 0.15, 3e-4: 0.25, 1e-3: 0.2})  # area / width
    final, _ = compare.choose_learning_rates(SweepRuns(), variants, lrs, 2)  # type: ignore[arg-type]
    assert final["a"] == pytest.approx({1e-4: 0.3, 3e-4: 0.5, 1e-3: 0.4})  # the last evaluation
    assert "a-lr0.0003-select1000" in runs.names and "b-lr0.001-select1001" in runs.names
    assert all("select" in name for name in runs.names)  # never the comparison's own seeds
    table = sweep_table(scores, chosen)
    assert "| a | 0.150 | 0.250 | 0.200 | 0.0003 |" in table


class CrossingRuns:
    """Two learning rates whose curves cross: 1e-3 leads early and falls back, 3e-4 rises
    slowly and ends higher (the final accuracy and the mean over the budget disagree)."""

    def summaries(self, planned):
        curves = {
            1e-4: [(0, 0.3), (10, 0.3), (20, 0.35)],
            3e-4: [(0, 0.3), (10, 0.35), (20, 0.6)],
            1e-3: [(0, 0.3), (10, 0.7), (20, 0.5)],
        }
        return [RunSummary("a", r.seed, curves[r.lr], 1.0, None, None, lr=r.lr) for r in planned]


def test_the_sweep_selects_by_the_metric_the_claim_is_about() -> None:
    """--select-by final picks the rate that ends highest; --select-by mean the one with
    the larger area (trapezoids over the width, written out here)."""
    variants = [compare.Variant("a", ())]
    lrs = (1e-4, 3e-4, 1e-3)
    final, chosen_final = compare.choose_learning_rates(CrossingRuns(), variants, lrs, 1)  # type: ignore[arg-type]
    mean, chosen_mean = compare.choose_learning_rates(
        CrossingRuns(),
        variants,
        lrs,
        1,
        compare.SELECT_BY["mean"],  # type: ignore[arg-type]
    )
    assert chosen_final == {"a": 3e-4} and final["a"][3e-4] == pytest.approx(0.6)
    assert mean["a"][1e-3] == pytest.approx(((0.3 + 0.7) / 2 * 10 + (0.7 + 0.5) / 2 * 10) / 20)
    assert chosen_mean == {"a": 1e-3}


def test_a_best_rate_at_the_grids_edge_is_refused_with_the_way_to_widen_it(tmp_path) -> None:
    chosen = {"fr": 1e-4, "grpo": 3e-4, "rloo": 1e-3}
    edges = compare.grid_edges(chosen, (1e-4, 3e-4, 1e-3))
    assert edges == {"fr": "lowest", "rloo": "highest"}
    assert compare.grid_edges({"fr": 3e-4}, (3e-4,)) == {"fr": "lowest"}  # one rate shows nothing
    with pytest.raises(compare.GridEdgeError) as refused:
        compare.refuse_grid_edges(edges, chosen, tmp_path / "sweep.md")
    message = str(refused.value)
    assert "Widen the grid" in message and str(tmp_path / "sweep.md") in message
    assert "fr's best is 0.0001, the grid's lowest (add rates below it)" in message
    assert "rloo's best is 0.001, the grid's highest (add rates above it)" in message
    compare.refuse_grid_edges({}, chosen, tmp_path / "sweep.md")  # interior: nothing raised
    table = sweep_table({"fr": {1e-4: 0.5, 3e-4: 0.4}}, {"fr": 1e-4}, {"fr": "lowest"})
    assert "| fr | 0.500 | 0.400 | 0.0001 (the grid's lowest: widen it) |" in table


def test_learning_rates_argument() -> None:
    assert compare.learning_rates("1e-4,3e-4,1e-4") == (1e-4, 3e-4)
    for bad in ("", "fast", "0", "2"):
        with pytest.raises(argparse.ArgumentTypeError):
            compare.learning_rates(bad)


def test_summaries_put_each_evaluation_on_every_budget(tmp_path: Path) -> None:
    from megatron_fr.analysis.compare_report import summarise

    lines = [
        '{"step": 0, "rollouts_total": 16, "eval_accuracy": 0.1}',
        '{"step": 1, "reward_mean": 0.5, "acceptance_rate": 1.0, "response_length_mean": 10}',
        '{"step": 2, "reward_mean": 0.5, "acceptance_rate": 1.0, "response_length_mean": 20}',
        '{"step": 2, "rollouts_total": 40, "eval_accuracy": 0.3}',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = summarise("fr", 0, tmp_path, batch_size=8)
    assert summary.on("trained") == [(0, 0.1), (16, 0.3)]
    assert summary.on("generated") == [(16, 0.1), (40, 0.3)]
    assert summary.on("tokens") == [(0, 0.1), (8 * 10 + 8 * 20, 0.3)]


def test_runs_that_spend_their_own_budgets_are_averaged_on_one_grid() -> None:
    """Generated rollouts differ per run at a given step: no two evaluations share a budget.
    Each curve is interpolated linearly at the mean of the runs' k-th budgets (0, 110, 210),
    the last kept within what both cover (200)."""
    a = [(0, 0.1), (100, 0.3), (200, 0.5)]
    b = [(0, 0.2), (120, 0.4), (220, 0.6)]
    a_110 = 0.3 + (10 / 100) * 0.2
    b_110 = 0.2 + (110 / 120) * 0.2
    b_200 = 0.4 + (80 / 100) * 0.2
    curve = stats.mean_curve([a, b])
    assert [x for x, _, _ in curve] == [0, 110, 200]
    assert [m for _, m, _ in curve] == pytest.approx([0.15, (a_110 + b_110) / 2, (0.5 + b_200) / 2])
    assert curve[1][2] == pytest.approx(abs(a_110 - b_110) / 2**0.5)  # sample std of two
    # Against a reference that spends twice as much per evaluation, the gap is read on the
    # grid of all four runs (mean budgets 0, 165, 310, kept within 200): ours at 165 are
    # 0.3 + 0.65 x 0.2 and 0.4 + 0.45 x 0.2; the reference's (0.1 -> 0.2 over 0 -> 230,
    # 0.15 -> 0.25 over 0 -> 210) at 165 are 0.1 + 165/230 x 0.1 and 0.15 + 165/210 x 0.1.
    reference = [[(0, 0.1), (230, 0.2), (400, 0.3)], [(0, 0.15), (210, 0.25), (420, 0.35)]]
    gaps = stats.gap_at_each_budget([a, b], reference)
    assert [x for x, _, _ in gaps] == [0, 165, 200]
    ours = (0.3 + 0.65 * 0.2 + 0.4 + 0.45 * 0.2) / 2
    theirs = (0.1 + 165 / 230 * 0.1 + 0.15 + 165 / 210 * 0.1) / 2
    assert gaps[1][1] == pytest.approx(ours - theirs)
    # The tokens axis of real runs starts every curve at 0 and shares nothing after: the
    # budget ratio is read on the grid, not divided by a zero-width budget.
    assert stats.budget_ratio([a, b], reference) is not None


def test_runs_whose_budgets_do_not_overlap_are_refused() -> None:
    with pytest.raises(ValueError, match="do not overlap"):
        stats.mean_curve([[(0, 0.1), (10, 0.2)], [(20, 0.3), (30, 0.4)]])


def test_tool_use_is_read_at_the_start_and_the_end_and_a_run_that_stops_is_counted() -> None:
    """Two runs of a tool task: one keeps calling (use rate 1.0 throughout), one stops after
    its first 10 steps; the table shows each figure first -> last 10 steps, mean over seeds,
    and counts the run that stopped."""
    from megatron_fr.analysis.compare_report import summarise, tool_table

    def records(use_after_10: float) -> list[dict]:
        rows: list[dict] = [{"step": 0, "eval_accuracy": 0.2, "rollouts_total": 0}]
        for step in range(1, 31):
            use = 1.0 if step <= 10 else use_after_10
            rows.append(
                {
                    "step": step,
                    "reward_mean": 0.5,
                    "acceptance_rate": 1.0,
                    "tool_calls_mean": 2.0 * use,
                    "tool_use_rate": use,
                    **({"tool_success_rate": 0.5} if use else {}),
                }
            )
        return [*rows, {"step": 30, "eval_accuracy": 0.3, "rollouts_total": 0}]

    keeps = summarise("grpo", 0, Path("unused"), 8, records=records(1.0))
    stops = summarise("grpo", 1, Path("unused"), 8, records=records(0.0))
    assert keeps.tool_use["tool_use_rate"] == (1.0, 1.0)
    assert stops.tool_use["tool_use_rate"] == (1.0, 0.0)
    assert stops.tool_use["tool_success_rate"] == (0.5, 0.5)  # over the steps that called
    table = tool_table({"grpo": [keeps, stops]})
    assert "| grpo | 2.00 -> 1.00 | 1.00 -> 0.50 | 0.50 -> 0.50 | 1 of 2 |" in table
    assert tool_table({"fr": [summarise("fr", 0, Path("u"), 8, records=records(1.0)[:1])]}) == ""
    never = [{**r, "tool_calls_mean": 0.0, "tool_use_rate": 0.0} for r in records(1.0)]
    assert summarise("math", 0, Path("u"), 8, records=never).tool_use == {}  # no tool task
