"""What a simulation reports, measured between the end of warm-up and the end of the last step.

    rollout_util     tokens decoded / (servers x peak tokens/s x window): how much of the
                     rollout GPUs' decode capacity was used (a server with one request is
                     busy but far from its batched peak)
    rollout_busy     share of server-time with at least one request decoding
    learner_util     share of the window the learner spent in optimizer steps
    sync_share       share spent in weight syncs (servers paused as well)
    learner_wait     share spent waiting for a batch
    trajectories_per_hour   trained trajectories (B per step) per hour of the window
    lag_*            lag = learner version at consumption - oldest version of a trajectory
                     (with scheme.stale_policy mask_stale_tokens, of its tokens trained)
    drop_share       trajectories dropped as too old / trajectories generated
    wasted_tokens    response tokens of dropped trajectories, and of trained ones made
                     context as too old (scheme.stale_policy mask_stale_tokens), / tokens
                     decoded
    masked_tokens    the second part alone / tokens decoded

Utilisations are shares of time or capacity, 0..1; the window excludes warm-up steps.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.engine import Scheme, Simulation, StepRecord, Totals
from megatron_fr.sim.lengths import LengthSampler


@dataclass(frozen=True)
class SimResult:
    scheme: str
    rollout_nodes: int
    learner_nodes: int
    servers: int
    steps_measured: int
    window_s: float
    rollout_util: float
    rollout_busy: float
    mean_running_per_server: float
    learner_util: float
    sync_share: float
    learner_wait: float
    trajectories_per_hour: float
    step_s_mean: float
    lag_histogram: dict[int, int]
    lag_mean: float
    lag_max: int
    drop_share: float
    wasted_tokens: float
    masked_tokens: float
    steps: list[StepRecord] = field(repr=False, compare=False)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("steps")
        return data


def summarize(simulation: Simulation) -> SimResult:
    """The report of a finished simulation (module docstring)."""
    config, scheme = simulation.config, simulation.scheme
    start, end = simulation.warm, simulation.end
    if start is None or end is None:
        raise ValueError("summarize needs a simulation that ran to its end (Simulation.run)")
    window = end.time - start.time
    measured = simulation.steps[config.warmup_steps :]
    servers = len(simulation.servers)
    peak = simulation.servers[0].decode.peak_tokens_per_s
    histogram = _difference(end, start)
    consumed = sum(histogram.values())
    completed = end.completed - start.completed
    decoded = end.decoded_tokens - start.decoded_tokens
    return SimResult(
        scheme=scheme.name,
        rollout_nodes=config.cluster.rollout_nodes,
        learner_nodes=config.cluster.learner_nodes,
        servers=servers,
        steps_measured=len(measured),
        window_s=window,
        rollout_util=decoded / (servers * peak * window),
        rollout_busy=(end.busy_s - start.busy_s) / (servers * window),
        mean_running_per_server=(end.running_s - start.running_s) / (servers * window),
        learner_util=sum(s.trained_s - s.batch_s for s in measured) / window,
        sync_share=sum(s.synced_s - s.trained_s for s in measured) / window,
        learner_wait=sum(s.batch_s - s.ready_s for s in measured) / window,
        trajectories_per_hour=consumed * 3600.0 / window,
        step_s_mean=statistics.fmean(s.synced_s - s.ready_s for s in measured),
        lag_histogram=histogram,
        lag_mean=sum(lag * n for lag, n in histogram.items()) / consumed,
        lag_max=max(histogram),
        drop_share=(end.dropped - start.dropped) / completed if completed else 0.0,
        wasted_tokens=(end.wasted_tokens - start.wasted_tokens) / decoded if decoded else 0.0,
        masked_tokens=(end.masked_tokens - start.masked_tokens) / decoded if decoded else 0.0,
        steps=list(simulation.steps),
    )


def simulate(config: SimConfig, scheme: Scheme, lengths: LengthSampler | None = None) -> SimResult:
    """Run one simulation and report it (sim/engine.py, this module)."""
    return summarize(Simulation(config, scheme, lengths).run())


def _difference(end: Totals, start: Totals) -> dict[int, int]:
    before = start.lag_histogram
    diff = {lag: n - before.get(lag, 0) for lag, n in end.lag_histogram.items()}
    return {lag: n for lag, n in sorted(diff.items()) if n}


TABLE_COLUMNS = (
    # header, width, format of one result
    ("scheme", 15, lambda r: r.scheme),
    ("R+L nodes", 9, lambda r: f"{r.rollout_nodes}+{r.learner_nodes}"),
    ("rollout util", 12, lambda r: f"{r.rollout_util:.1%}"),
    ("busy", 6, lambda r: f"{r.rollout_busy:.0%}"),
    ("req/srv", 7, lambda r: f"{r.mean_running_per_server:.1f}"),
    ("learner", 7, lambda r: f"{r.learner_util:.1%}"),
    ("sync", 6, lambda r: f"{r.sync_share:.1%}"),
    ("step s", 7, lambda r: f"{r.step_s_mean:.1f}"),
    ("traj/h", 8, lambda r: f"{r.trajectories_per_hour:,.0f}"),
    ("lag mean", 8, lambda r: f"{r.lag_mean:.2f}"),
    ("max", 3, lambda r: f"{r.lag_max}"),
    ("dropped", 7, lambda r: f"{r.drop_share:.1%}"),
    ("tokens wasted", 13, lambda r: f"{r.wasted_tokens:.1%}"),
)


def format_table(results: list[SimResult]) -> str:
    header = "  ".join(name.rjust(width) for name, width, _ in TABLE_COLUMNS)
    rows = ["  ".join(cell(r).rjust(width) for _, width, cell in TABLE_COLUMNS) for r in results]
    return "\n".join([header, *rows])
