"""RunLogger / read_metrics: round trips, validation, crash remnants, resume, TensorBoard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_fr.analysis.run_files import read_metrics
from megatron_fr.orchestrator.run_log import (
    EVAL_KEYS,
    STEP_KEYS,
    RunLogger,
    last_step,
    read_config_header,
    save_resolved_config,
)
from megatron_fr.orchestrator.sinks import TensorBoardSink


def step_metrics(step: int, **extra: float) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "reward_mean": 0.1 * step,
        "acceptance_rate": 0.9,
        "lag_mean": 1.5,
        "lag_max": 3,
        "tokens_per_s": 1234.5,
        "rollouts_total": 64 * step,
        **extra,
    }


def eval_metrics(step: int) -> dict:
    return {
        "step": step,
        "rollouts_total": 64 * step,
        "eval_accuracy": 0.25,
        "eval_accuracy_std": 0.05,
    }


def write_lines(run_dir: Path, text: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text(text, encoding="utf-8")
    return path


def test_steps_and_evals_read_back_equal(tmp_path):
    written = [step_metrics(1, loss=0.75), step_metrics(2), eval_metrics(2), step_metrics(3)]
    with RunLogger(tmp_path) as logger:
        for record in written:
            (logger.log_eval if "eval_accuracy" in record else logger.log_step)(record)
    assert read_metrics(tmp_path) == written
    assert last_step(tmp_path) == 3
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_tensor_scalars_are_stored_as_numbers(tmp_path):
    with RunLogger(tmp_path) as logger:
        logger.log_step(step_metrics(1, reward_mean=torch.tensor(0.5), grad_norm=torch.tensor(2)))
    (record,) = read_metrics(tmp_path)
    assert record["reward_mean"] == 0.5 and record["grad_norm"] == 2
    assert isinstance(record["grad_norm"], int)


@pytest.mark.parametrize("key", STEP_KEYS)
def test_log_step_missing_key_names_it(tmp_path, key):
    metrics = step_metrics(1)
    del metrics[key]
    with (
        RunLogger(tmp_path) as logger,
        pytest.raises(ValueError, match=f"'{key}' is missing"),
    ):
        logger.log_step(metrics)
    assert read_metrics(tmp_path) == []


@pytest.mark.parametrize("key", EVAL_KEYS)
def test_log_eval_missing_key_names_it(tmp_path, key):
    metrics = eval_metrics(1)
    del metrics[key]
    with (
        RunLogger(tmp_path) as logger,
        pytest.raises(ValueError, match=f"'{key}' is missing"),
    ):
        logger.log_eval(metrics)


def test_non_numeric_required_value_is_rejected(tmp_path):
    with RunLogger(tmp_path) as logger:
        with pytest.raises(ValueError, match="'lag_max' must be a number"):
            logger.log_step(step_metrics(1, lag_max="3"))
        with pytest.raises(ValueError, match="'step' must be an int"):
            logger.log_step({**step_metrics(1), "step": 1.0})


def test_truncated_last_line_is_skipped(tmp_path):
    full = [step_metrics(1), step_metrics(2)]
    write_lines(tmp_path, "".join(json.dumps(r) + "\n" for r in full) + '{"step": 3, "rew')
    assert read_metrics(tmp_path) == full
    assert last_step(tmp_path) == 2


def test_corrupt_middle_line_raises_with_its_line_number(tmp_path):
    good = json.dumps(step_metrics(1)) + "\n"
    write_lines(tmp_path, good + '{"step": 2, "rew\n' + good)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: malformed"):
        read_metrics(tmp_path)


def test_reopen_continues_after_a_line_cut_by_a_kill(tmp_path):
    with RunLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log_step(step_metrics(step))
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write(json.dumps(step_metrics(4))[:40])
    with RunLogger(tmp_path) as logger:
        logger.log_step(step_metrics(4))
        logger.log_step(step_metrics(5))
    assert read_metrics(tmp_path) == [step_metrics(s) for s in (1, 2, 3, 4, 5)]


def test_reopen_keeps_a_complete_last_line_that_lost_its_newline(tmp_path):
    write_lines(tmp_path, json.dumps(step_metrics(1)) + "\n" + json.dumps(step_metrics(2)))
    with RunLogger(tmp_path) as logger:
        logger.log_step(step_metrics(3))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


CHILD = textwrap.dedent(
    """
    import itertools, sys
    from megatron_fr.orchestrator.run_log import RunLogger
    logger = RunLogger(sys.argv[1])
    for step in itertools.count(1):
        logger.log_step({"step": step, "policy_version": step, "reward_mean": 0.5,
                         "acceptance_rate": 1.0, "lag_mean": 0.0, "lag_max": 0,
                         "tokens_per_s": 1.0, "rollouts_total": step, "pad": "x" * 4000})
    """
)


def test_sigkill_mid_run_then_resume(tmp_path):
    """A real SIGKILL of a process that logs as fast as it can, then a resumed logger."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], stderr=subprocess.DEVNULL
    )
    path = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (path.exists() and path.stat().st_size > 200_000):
        assert child.poll() is None and time.monotonic() < deadline, "logging child stalled"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    done = last_step(tmp_path)
    assert done is not None and done >= 40
    with RunLogger(tmp_path) as logger:
        logger.log_step(step_metrics(done + 1))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, done + 2))


def test_tensorboard_holds_every_numeric_key_by_step(tmp_path):
    with RunLogger(tmp_path, sinks=[TensorBoardSink(tmp_path)]) as logger:
        logger.log_step(step_metrics(1, note="text is not a scalar"))
        logger.log_step(step_metrics(2))
        logger.log_eval(eval_metrics(2))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"train/{key}" for key in STEP_KEYS if key != "step"} <= tags
    assert {"eval/accuracy", "eval/accuracy_std"} <= tags
    assert not any("note" in tag or tag.endswith("/step") for tag in tags)
    rewards = events.Scalars("train/reward_mean")
    assert [(e.step, e.value) for e in rewards] == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.2)),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(2, 0.25)]


def test_disabled_logger_writes_nothing(tmp_path):
    run_dir = tmp_path / "rank1"
    with RunLogger(run_dir, progress_total=10, enabled=False) as logger:
        logger.log_step(step_metrics(1))
        logger.log_step({"step": 2})  # not even validated: non-zero ranks pay nothing
        logger.log_eval(eval_metrics(2))
    assert not run_dir.exists()


def test_progress_bar_starts_at_the_resumed_step(tmp_path, capsys):
    with RunLogger(tmp_path, progress_total=10) as logger:
        for step in (1, 2, 3):
            logger.log_step(step_metrics(step))
        logger.log_eval(eval_metrics(3))
    capsys.readouterr()
    with RunLogger(tmp_path, progress_total=10) as logger:
        assert "3/10" in capsys.readouterr().err
        logger.log_step(step_metrics(4))
        bar = capsys.readouterr().err
    assert "4/10" in bar
    assert "reward=0.4" in bar and "accept=0.9" in bar and "lag=1.5" in bar
    assert "eval_acc=0.25" in bar  # remembered from before the restart


def test_closed_logger_refuses_to_write(tmp_path):
    logger = RunLogger(tmp_path)
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log_step(step_metrics(1))


def test_missing_run_dir_is_named(tmp_path):
    missing = tmp_path / "no_such_run"
    with pytest.raises(FileNotFoundError, match="no_such_run"):
        read_metrics(missing)
    (missing).mkdir()
    with pytest.raises(FileNotFoundError, match=r"no_such_run/metrics\.jsonl"):
        read_metrics(missing)
    assert last_step(missing) is None


def test_resolved_config_keeps_key_order(tmp_path):
    config = {"model": {"name": "qwen3-0.6b", "tp": 2}, "algo": {"lr": 1e-6}, "steps": 100}
    path = save_resolved_config(tmp_path / "run", config)
    assert path == tmp_path / "run" / "config.yaml"
    assert yaml.safe_load(path.read_text()) == config
    assert path.read_text().splitlines()[0] == "model:"
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]


def test_the_config_header_reads_back_what_was_written_above_the_config(tmp_path):
    header = {"model_sha256": "c21d" * 16, "commit": "5275030-dirty"}
    path = save_resolved_config(tmp_path / "run", {"steps": 3, "note": "# not a header"}, header)
    assert read_config_header(path.parent) == header
    assert yaml.safe_load(path.read_text()) == {"steps": 3, "note": "# not a header"}
    assert read_config_header(tmp_path / "never_ran") == {}
