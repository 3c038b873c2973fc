"""Many simulations: the two schemes across cluster sizes, and the rollout/learner split that
suits a target lag (--suggest).

How a split is chosen: every split whose learner nodes can hold the model (launch/plan.py, when
a GPU memory is given) is simulated with max_lag = the target; those that drop more than
`max_drop_share` of their rollouts as too old are ruled out (unless all do: the drops then
come from the target lag and the response lengths, and the report says so); of the rest, the
splits within `tolerance` of the best trajectories per hour are near-equal, and the one with
the lowest mean lag among them wins (fresher data for the same throughput). Throughput is
min(what the rollout nodes generate, what the learner nodes consume), so it rises with rollout
nodes until the learner becomes the bottleneck and falls after; with more than 16 splits a
coarse grid is simulated first and the neighbourhood of its best point is then filled in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from megatron_fr.launch.plan import enumerate_layouts
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.engine import SCHEMES, flash_reinforce
from megatron_fr.sim.result import SimResult, simulate

EXHAUSTIVE_UP_TO = 16
"""Splits simulated one by one up to this many; a coarse grid first beyond."""


def split_nodes(total: int, rollout_fraction: float) -> tuple[int, int]:
    """(rollout, learner) nodes out of `total`, at least one of each."""
    if total < 2:
        raise ValueError(f"a run needs at least 2 nodes (1 rollout + 1 learner), got {total}")
    rollout = min(total - 1, max(1, round(total * rollout_fraction)))
    return rollout, total - rollout


def sweep(config: SimConfig, node_counts: list[int], rollout_fraction: float) -> list[SimResult]:
    """Both schemes at each total node count, split by rollout_fraction."""
    runs = [(n, name) for n in node_counts for name in SCHEMES]
    results = []
    for total, name in tqdm(runs, desc="simulating", unit="run"):
        split = config.with_split(*split_nodes(total, rollout_fraction))
        results.append(simulate(split, SCHEMES[name](split.scheme)))
    return results


@dataclass(frozen=True)
class Suggestion:
    total_nodes: int
    target_lag: int
    chosen: SimResult
    results: list[SimResult]
    """Every split simulated, by rollout nodes."""
    skipped: dict[int, str]
    """Rollout node counts not simulated, with the reason."""
    reason: str


def learner_fits(config: SimConfig, learner_nodes: int) -> bool:
    """Whether some layout of the model fits learner_nodes nodes (always True without a GPU
    memory to check against)."""
    learner = config.learner
    if learner.gpu_mem_gb is None or learner.seconds_per_step is not None:
        return True
    layouts = enumerate_layouts(
        load_hf_config(learner.model),
        learner_nodes * config.cluster.gpus_per_node,
        config.cluster.gpus_per_node,
        micro_batch_tokens=learner.micro_batch_tokens,
        gpu_mem_gib=learner.gpu_mem_gb,
    )
    return bool(layouts)


def suggest(
    config: SimConfig,
    total_nodes: int,
    target_lag: int,
    *,
    max_drop_share: float = 0.05,
    tolerance: float = 0.02,
) -> Suggestion:
    """The split of total_nodes for FlashREINFORCE at max_lag = target_lag (module docstring)."""
    scheme_settings = config.scheme.model_copy(update={"max_lag": target_lag, "capacity": None})
    config = config.model_copy(update={"scheme": scheme_settings})
    skipped = {
        r: f"the model does not fit on {total_nodes - r} learner node(s)"
        for r in range(1, total_nodes)
        if not learner_fits(config, total_nodes - r)
    }
    splits = [r for r in range(1, total_nodes) if r not in skipped]
    if not splits:
        raise ValueError(f"no split of {total_nodes} nodes has learner nodes that hold the model")
    bar = tqdm(desc="simulating splits", unit="run")
    done: dict[int, SimResult] = {}

    def run(rollout: int) -> SimResult:
        if rollout not in done:
            split = config.with_split(rollout, total_nodes - rollout)
            done[rollout] = simulate(split, flash_reinforce(split.scheme))
            bar.update()
        return done[rollout]

    _search(splits, run)
    bar.close()
    results = [done[r] for r in sorted(done)]
    budget = (target_lag + 1) * config.scheme.batch_size
    chosen, reason = _choose(results, max_drop_share, tolerance, target_lag, budget)
    return Suggestion(total_nodes, target_lag, chosen, results, skipped, reason)


def _search(splits: list[int], run: Callable[[int], SimResult]) -> None:
    if len(splits) <= EXHAUSTIVE_UP_TO:
        for rollout in splits:
            run(rollout)
        return
    stride = len(splits) / (EXHAUSTIVE_UP_TO - 1)
    grid = sorted(
        {splits[min(len(splits) - 1, round(i * stride))] for i in range(EXHAUSTIVE_UP_TO)}
    )
    best = max(grid, key=lambda r: run(r).trajectories_per_hour)
    at = grid.index(best)
    low, high = grid[max(at - 1, 0)], grid[min(at + 1, len(grid) - 1)]
    for rollout in splits:
        if low <= rollout <= high:
            run(rollout)


def _choose(
    results: list[SimResult], max_drop_share: float, tolerance: float, target_lag: int, budget: int
) -> tuple[SimResult, str]:
    feasible = [r for r in results if r.drop_share <= max_drop_share]
    note = ""
    if not feasible:  # the lag target and the lengths, more than the split, set the drops then
        least = min(results, key=lambda r: r.drop_share)
        feasible = results
        note = (
            f"\nNo split keeps drops under {max_drop_share:.0%}, so they were not used to "
            f"choose; the least is {least.drop_share:.1%} ({least.rollout_nodes} rollout "
            f"nodes, {least.trajectories_per_hour:,.0f} trajectories/h). The dropped are the "
            "long responses, which outlive their staleness budget: a larger target lag, a "
            "smaller max_new_tokens or scheme.stale_policy=mask_stale_tokens (which trains "
            "their tokens within the lag) keeps them."
        )
    best = max(r.trajectories_per_hour for r in feasible)
    near = [r for r in feasible if r.trajectories_per_hour >= (1 - tolerance) * best]
    chosen = min(near, key=lambda r: (r.lag_mean, r.rollout_nodes))
    return chosen, _explain(chosen, results, near, target_lag, tolerance, budget) + note


def _explain(
    chosen: SimResult,
    results: list[SimResult],
    near: list[SimResult],
    target_lag: int,
    tolerance: float,
    budget: int,
) -> str:
    c = chosen
    lines = [
        f"{c.rollout_nodes} rollout + {c.learner_nodes} learner nodes: "
        f"{c.trajectories_per_hour:,.0f} trajectories/h at lag mean {c.lag_mean:.2f} "
        f"(max_lag {target_lag}), {c.drop_share:.1%} dropped as too old.",
        _bottleneck(c, results, budget),
    ]
    for other in results:
        if abs(other.rollout_nodes - c.rollout_nodes) == 1:
            lines.append(
                f"With {other.rollout_nodes} rollout nodes: {other.trajectories_per_hour:,.0f} "
                f"trajectories/h, lag mean {other.lag_mean:.2f}, {other.drop_share:.1%} dropped."
            )
    if len(near) > 1:
        lines.append(
            f"{len(near)} splits come within {tolerance:.0%} of the best throughput; this one "
            "has the lowest mean lag of them."
        )
    return "\n".join(lines)


SATURATED = 0.8
"""Share of the servers' decode peak above which generation counts as capacity-bound."""


def _bottleneck(c: SimResult, results: list[SimResult], budget: int) -> str:
    """Which limit sets the pace: the learner, the servers' capacity, or the staleness budget
    (the buffer admits at most `budget` pending rollouts, however many servers there are)."""
    if c.learner_wait < 0.1:
        return (
            f"Learner-bound: the learner trains {c.learner_util:.0%} and syncs {c.sync_share:.0%} "
            f"of the time and waits {c.learner_wait:.0%}; more rollout nodes would raise lag and "
            "drops, not throughput."
        )
    text = f"Rollout-bound: the learner waits {c.learner_wait:.0%} of the time for batches. "
    if c.rollout_util >= SATURATED:
        text += f"The servers decode at {c.rollout_util:.0%} of their peak: they are the limit."
    else:
        text += (
            f"The servers use {c.rollout_util:.0%} of their decode peak with "
            f"{c.mean_running_per_server:.1f} requests each: the staleness budget ({budget} "
            "pending rollouts, (max_lag + 1) x B) rather than the server count caps what is in "
            "flight, and long responses set the pace; a larger batch or target lag fills them."
        )
    if c.rollout_nodes == max(r.rollout_nodes for r in results):
        text += " The most rollout nodes tried still leave the learner waiting."
    return text
