"""The simulator's validation hook on run directories laid out as a training run leaves them
(config.yaml as RunConfig dumps it, metrics.jsonl with session.log_step's fields, a checkpoint's
controller.json with the buffer's lag histogram). The measured figures here come from a
simulation with known server speeds written in that layout, since no real cluster run exists
to read yet."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import yaml

from megatron_fr.config.buffer import BufferConfig
from megatron_fr.config.run import RunConfig
from megatron_fr.sim.config import SimConfig
from megatron_fr.sim.engine import Scheme
from megatron_fr.sim.result import SimResult, simulate
from megatron_fr.sim.validate import format_validation, read_run, run_sim_config, validate_run

BUFFER = BufferConfig(batch_size=8, max_lag=2, capacity=24)
PROMPT = 20


def truth(train_s: float, peak: float, single: float = 20.0) -> tuple[SimConfig, Scheme]:
    """Two servers, the run's buffer; lengths lognormal around 200 response tokens."""
    config = SimConfig.model_validate(
        {
            "cluster": {"rollout_nodes": 2, "gpus_per_node": 1},
            "server": {
                "gpus_per_server": 1,
                "single_stream_tokens_per_s": single,
                "peak_tokens_per_s": peak,
            },
            "learner": {"seconds_per_step": train_s},
            "sync": {"bytes": 0, "latency_s": 0.5},
            "lengths": {"median_tokens": 200, "sigma": 0.8, "prompt_tokens": PROMPT},
            "steps": 60,
            "warmup_steps": 0,
            "seed": 5,
        }
    )
    return config, Scheme("run", BUFFER)


def write_run(run_dir, result: SimResult, drop_total: int, rollouts_total: int) -> None:
    """The run directory a training run with these steps would leave (session.log_step)."""
    run = RunConfig(
        steps=len(result.steps),
        buffer=BUFFER,
        model={"hf_dir": "/models/tiny"},
        task={"name": "math", "train": {"path": "/data/train.jsonl"}},
        rollout={"engine": {"urls": ["http://a:1", "http://b:1"]}},
    )
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    lines = []
    for s in result.steps:
        step_s = s.synced_s - s.ready_s
        lines.append(
            dict(
                step=s.step,
                policy_version=s.step,
                reward_mean=0.0,
                acceptance_rate=1.0,
                lag_mean=statistics.fmean(s.lags),
                lag_max=max(s.lags),
                tokens_per_s=s.tokens / step_s,
                rollouts_total=rollouts_total,
                loss=0.0,
                grad_norm=0.0,
                lr=1e-6,
                sync_s=s.synced_s - s.trained_s,
                buffer_occupancy=0,
                dropped_total=drop_total,
                step_s=step_s,
            )
        )
    lines.insert(3, {"step": 3, "rollouts_total": 1, "eval_accuracy": 0.5})  # an eval line
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    checkpoint = run_dir / "checkpoints" / "step_00000050"
    checkpoint.mkdir(parents=True)
    histogram = sorted(result.lag_histogram.items())
    state = {"step": 50, "rollout": {"buffer": {"lag_histogram": histogram}}}
    (checkpoint / "controller.json").write_text(json.dumps(state))
    (run_dir / "checkpoints" / "latest").write_text("step_00000050\n")


def test_read_run_takes_the_logged_figures(tmp_path):
    config, scheme = truth(train_s=1.0, peak=200.0)
    result = simulate(config, scheme)
    write_run(tmp_path / "run", result, drop_total=3, rollouts_total=600)
    figures = read_run(tmp_path / "run")
    steps = [s.synced_s - s.ready_s for s in result.steps]
    assert figures.steps == 60 and figures.servers == 2
    assert figures.scheme == Scheme("run", BUFFER)
    assert figures.step_s_mean == pytest.approx(statistics.fmean(steps))
    assert figures.sync_s == pytest.approx(0.5)
    assert figures.train_s == pytest.approx(sorted(x - 0.5 for x in steps)[6])  # 10th pct
    tokens = statistics.fmean(s.tokens / 8 for s in result.steps)
    assert figures.tokens_per_trajectory == pytest.approx(tokens)
    assert figures.drop_share == pytest.approx(3 / 600)
    assert figures.lag_histogram == result.lag_histogram and figures.histogram_step == 50
    sim = run_sim_config(
        figures, SimConfig().model_copy(update={"lengths": config.lengths}), scale=2.0
    )
    assert (sim.servers, sim.server.peak_tokens_per_s) == (
        2,
        2 * SimConfig().server.peak_tokens_per_s,
    )
    mean_response = sim.lengths.median_tokens * math.exp(0.8**2 / 2)
    assert mean_response == pytest.approx(tokens - PROMPT)


def test_calibration_matches_the_step_time_of_a_rollout_bound_run(tmp_path):
    """Generated with peak 200 tokens/s per server; the base settings say 4x slower. The
    calibrated simulation reproduces the measured step time and lag."""
    config, scheme = truth(train_s=1.0, peak=200.0)
    result = simulate(config, scheme)
    assert result.learner_wait > 0.2  # rollout-bound: the servers' speed sets the pace
    write_run(tmp_path / "run", result, drop_total=0, rollouts_total=600)
    base = config.model_copy(
        update={
            "server": config.server.model_copy(
                update={"single_stream_tokens_per_s": 5.0, "peak_tokens_per_s": 50.0}
            )
        }
    )
    validation = validate_run(tmp_path / "run", base)
    assert validation.identifiable
    assert validation.predicted.step_s_mean == pytest.approx(result.step_s_mean, rel=0.02)
    assert 2.0 < validation.scale < 8.0
    assert validation.predicted.lag_mean == pytest.approx(result.lag_mean, abs=0.3)
    text = format_validation(validation)
    assert "calibrated" in text and "checkpoint, step 50" in text


def test_learner_bound_run_is_not_calibrated(tmp_path):
    config, scheme = truth(train_s=6.0, peak=2000.0, single=200.0)
    result = simulate(config, scheme)
    assert result.learner_wait < 0.05
    write_run(tmp_path / "run", result, drop_total=0, rollouts_total=600)
    validation = validate_run(tmp_path / "run", config)
    assert not validation.identifiable
    assert "learner-bound" in format_validation(validation)


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"config\.yaml not found"):
        read_run(tmp_path)
    config, scheme = truth(train_s=1.0, peak=200.0)
    write_run(tmp_path / "run", simulate(config, scheme), drop_total=0, rollouts_total=1)
    path = tmp_path / "run" / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    del lines[5]["sync_s"]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=f"step {lines[5]['step']} has no 'sync_s'"):
        read_run(tmp_path / "run")
