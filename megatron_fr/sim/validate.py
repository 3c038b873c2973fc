"""Check the simulator against a finished run: predict its lag and drops from its own figures.

What a run directory gives today (orchestrator/report.py, run_log.py):
    config.yaml     buffer (B, G, max_lag, capacity, max_in_flight), engine urls
    metrics.jsonl   per step: step_s (wait for the batch + train + sync), sync_s, tokens_per_s
                    (batch tokens / step_s), lag_mean, lag_max, rollouts_total, dropped_total
    checkpoints/latest -> controller.json: the buffer's lag histogram up to that step

From these the simulation is set up as the run was: the run's buffer and group size, one
simulated server per engine URL, sync = the median sync_s, a training step of the 10th
percentile of step_s - sync_s (the steps whose batch was waiting already, since the time spent
waiting is not logged on its own), and responses whose mean matches the batches' mean tokens
(tokens_per_s * step_s / B, less the prompt). One unknown is left: the servers' speed. It is
scaled (both decode rates by the same factor) until the simulated mean step time matches the
measured one; the lag histogram and the drop share are then predictions. When the learner is
the bottleneck the step time does not depend on the servers' speed and the factor cannot be
found; the report says so.

The servers' batching curve is not fitted, only scaled: give its shape. The CPU engine
(engine/cpu/server.py) decodes its requests one token each in turn under one lock and serves 32
at once, i.e. server.single_stream_tokens_per_s = server.peak_tokens_per_s and
server.max_running_requests=32; the CPU demo's prompts, rendered by its chat template, are 30 or
31 tokens (lengths.prompt_tokens).

Not logged today, and what would make the check sharp: the time the learner waits for each
batch and the time it trains, separately (the train-time estimate above is a guess); per
trajectory its prompt and response tokens, its admission, first-token and finish times, its
server and the syncs it crossed (its continuations); per step the rollouts in flight and queued
when the batch was taken, and the rollouts completed and dropped during the step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_fr.analysis.run_files import CONFIG_FILE, read_metrics
from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator.checkpoints import latest_checkpoint, load_controller_state
from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.engine import Scheme
from megatron_fr.sim.result import SimResult, simulate

TRAIN_QUANTILE = 0.1
"""Which quantile of step_s - sync_s stands for the training time (module docstring)."""
SCALE_RANGE = (1 / 256, 256.0)
"""Factors on the servers' decode rates that calibration searches."""
CALIBRATION_ROUNDS = 16


@dataclass(frozen=True)
class RunFigures:
    """What the run measured, and the settings it ran with."""

    steps: int
    step_s_mean: float
    train_s: float
    sync_s: float
    tokens_per_trajectory: float
    lag_mean: float
    lag_max: int
    drop_share: float | None
    lag_histogram: dict[int, int] | None
    histogram_step: int | None
    servers: int
    scheme: Scheme


def read_run(run_dir: str | Path) -> RunFigures:
    """The figures of run_dir; ValueError naming the file and field when one is missing."""
    run_dir = Path(run_dir)
    config = _run_config(run_dir)
    steps = [r for r in read_metrics(run_dir) if "step_s" in r]
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step line with step_s")
    for key in ("sync_s", "tokens_per_s", "lag_mean", "lag_max", "rollouts_total"):
        missing = [r["step"] for r in steps if key not in r]
        if missing:
            raise ValueError(f"{run_dir}/metrics.jsonl: step {missing[0]} has no {key!r}")
    batch = config.buffer.batch_size
    last = steps[-1]
    histogram, at_step = _checkpoint_histogram(run_dir)
    return RunFigures(
        steps=len(steps),
        step_s_mean=statistics.fmean(r["step_s"] for r in steps),
        train_s=_quantile([r["step_s"] - r["sync_s"] for r in steps], TRAIN_QUANTILE),
        sync_s=statistics.median(r["sync_s"] for r in steps),
        tokens_per_trajectory=statistics.fmean(
            r["tokens_per_s"] * r["step_s"] / batch for r in steps
        ),
        lag_mean=statistics.fmean(r["lag_mean"] for r in steps),
        lag_max=max(r["lag_max"] for r in steps),
        drop_share=last["dropped_total"] / last["rollouts_total"]
        if "dropped_total" in last and last["rollouts_total"]
        else None,
        lag_histogram=histogram,
        histogram_step=at_step,
        servers=max(1, len(config.rollout.engine.urls)),
        scheme=Scheme("run", config.buffer),
    )


def _run_config(run_dir: Path) -> RunConfig:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found: not a run directory")
    try:
        return RunConfig.model_validate(yaml.safe_load(path.read_text()))
    except ValueError as error:
        raise ValueError(f"{path}: not a run config ({error})") from None


def _checkpoint_histogram(run_dir: Path) -> tuple[dict[int, int] | None, int | None]:
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return None, None
    state = load_controller_state(checkpoint)
    histogram = state["rollout"]["buffer"]["lag_histogram"]
    return {int(lag): n for lag, n in histogram}, state["step"]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_sim_config(figures: RunFigures, base: SimConfig, scale: float = 1.0) -> SimConfig:
    """`base` set up as the run was (module docstring), the decode rates times `scale`."""
    if base.lengths.file is None:
        response = figures.tokens_per_trajectory - base.lengths.prompt_tokens
        if response < 1:
            raise ValueError(
                f"the run's trajectories average {figures.tokens_per_trajectory:.0f} tokens, "
                f"not more than lengths.prompt_tokens ({base.lengths.prompt_tokens}): "
                "set lengths.prompt_tokens to the run's prompt length"
            )
        median = response / math.exp(base.lengths.sigma**2 / 2)  # lognormal mean -> median
        base = base.model_copy(
            update={"lengths": base.lengths.model_copy(update={"median_tokens": median})}
        )
    server = base.server.model_copy(
        update={
            "gpus_per_server": 1,
            "single_stream_tokens_per_s": base.server.single_stream_tokens_per_s * scale,
            "peak_tokens_per_s": base.server.peak_tokens_per_s * scale,
        }
    )
    return base.model_copy(
        update={
            "cluster": base.cluster.model_copy(
                update={"rollout_nodes": figures.servers, "learner_nodes": 1, "gpus_per_node": 1}
            ),
            "server": server,
            "learner": base.learner.model_copy(
                update={"seconds_per_step": max(figures.train_s, 1e-6)}
            ),
            "sync": base.sync.model_copy(update={"bytes": 0, "latency_s": figures.sync_s}),
            "steps": figures.steps,
            "warmup_steps": 0,
        }
    )


@dataclass(frozen=True)
class Validation:
    figures: RunFigures
    predicted: SimResult
    scale: float
    identifiable: bool


def validate_run(run_dir: str | Path, base: SimConfig) -> Validation:
    """Calibrate the servers' speed on the run's step time, then predict its lag and drops."""
    figures = read_run(run_dir)

    def simulate_at(scale: float) -> SimResult:
        return simulate(run_sim_config(figures, base, scale), figures.scheme)

    low, high = SCALE_RANGE
    fastest = simulate_at(high)
    if fastest.step_s_mean * 1.02 >= figures.step_s_mean:
        return Validation(figures, fastest, high, identifiable=False)
    for _ in range(CALIBRATION_ROUNDS):  # bisection on log(scale): step time falls as it grows
        middle = math.sqrt(low * high)
        if simulate_at(middle).step_s_mean > figures.step_s_mean:
            low = middle
        else:
            high = middle
    scale = math.sqrt(low * high)
    return Validation(figures, simulate_at(scale), scale, identifiable=True)


def format_validation(validation: Validation) -> str:
    f, p = validation.figures, validation.predicted
    if validation.identifiable:
        head = f"servers' decode rates calibrated x{validation.scale:.3g} to match the step time"
    else:
        head = (
            "learner-bound run: the step time does not depend on the servers' speed, so it was "
            f"not calibrated (servers x{validation.scale:.3g}, i.e. never the bottleneck)"
        )
    measured_drops = "n/a" if f.drop_share is None else f"{f.drop_share:.2%}"
    rows = [
        ("step s (mean)", f"{p.step_s_mean:.3f}", f"{f.step_s_mean:.3f}"),
        ("lag mean", f"{p.lag_mean:.3f}", f"{f.lag_mean:.3f}"),
        ("lag max", f"{p.lag_max}", f"{f.lag_max}"),
        ("dropped / generated", f"{p.drop_share:.2%}", measured_drops),
    ]
    lines = [head, f"{'':24}{'predicted':>12}{'measured':>12}"]
    lines += [f"{name:24}{pred:>12}{meas:>12}" for name, pred, meas in rows]
    lines.append(_histogram_lines(p.lag_histogram, f.lag_histogram, f.histogram_step))
    return "\n".join(lines)


def _histogram_lines(
    predicted: dict[int, int], measured: dict[int, int] | None, step: int | None
) -> str:
    label = "no checkpoint" if measured is None else f"checkpoint, step {step}"
    lines = [f"lag histogram, share of trained trajectories (measured: {label})"]
    measured = measured or {}
    p_total, m_total = sum(predicted.values()), sum(measured.values())
    for lag in sorted(set(predicted) | set(measured)):
        pred = f"{predicted.get(lag, 0) / p_total:.1%}"
        meas = f"{measured.get(lag, 0) / m_total:.1%}" if m_total else "n/a"
        lines.append(f"  lag {lag:<18}{pred:>12}{meas:>12}")
    return "\n".join(lines)
