"""The metric sinks besides metrics.jsonl: a Weights & Biases run in offline mode (no network),
read back from the transaction log wandb itself wrote (its framed record format, decoded with
wandb's own protobuf classes), must hold every numeric value metrics.jsonl holds, keyed by
step; a restart of the same run directory continues the same W&B run id."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from megatron_fr.analysis.run_files import read_metrics
from megatron_fr.config.report import ReportConfig, WandbConfig
from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator.run_log import RunLogger
from megatron_fr.orchestrator.sinks import WANDB_DIR, WandbSink, build_sinks

REPO = Path(__file__).resolve().parents[2]
BLOCK = 32768
"""wandb's log: a 7-byte file header, then records framed LevelDB-style in 32 KiB blocks, each
chunk behind a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""


def history(run_file: Path, rows: int) -> list[dict[str, float]]:
    """The history rows of a .wandb file, without W&B's own underscore keys, once `rows` of
    them are there (wandb's core process writes the file on its own after finish())."""
    deadline = time.monotonic() + 30
    while len(found := read_history(run_file)) < rows and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def read_history(run_file: Path) -> list[dict[str, float]]:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    rows, pending, position = [], b"", 7
    while position + 7 <= len(data):
        room = BLOCK - position % BLOCK
        if room < 7:
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:  # block padding
            position += room
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): float(item.value_json)
                    for item in record.history.item
                }
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def step_line(step: int, reward: float) -> dict:
    return dict(
        step=step,
        policy_version=step,
        reward_mean=reward,
        acceptance_rate=1.0,
        lag_mean=0.5,
        lag_max=1,
        tokens_per_s=10.0,
        rollouts_total=16 * step,
        finish="text is not a number",
    )


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> WandbConfig:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return WandbConfig(project="megatron-fr-test", mode="offline", tags=("ci",))


def test_an_offline_wandb_run_holds_what_metrics_jsonl_holds(tmp_path: Path, offline) -> None:
    sink = WandbSink(offline, tmp_path, {"steps": 2})
    with RunLogger(tmp_path, sinks=[sink]) as logger:
        logger.log_step(step_line(1, 0.25))
        logger.log_step(step_line(2, 0.5))
        logger.log_eval(dict(step=2, rollouts_total=32, eval_accuracy=0.75, eval_accuracy_std=0.1))
    (run_file,) = (tmp_path / WANDB_DIR).glob("offline-run-*/run-*.wandb")
    rows = history(run_file, 3)
    expected = []
    for line in read_metrics(tmp_path):
        scope = "eval" if "eval_accuracy" in line else "train"
        numbers = {
            k: float(v) for k, v in line.items() if isinstance(v, int | float) and k != "step"
        }
        names = {
            f"{scope}/{k.removeprefix('eval_') if scope == 'eval' else k}": v
            for k, v in numbers.items()
        }
        expected.append({"step": float(line["step"]), **names})
    assert rows == expected
    assert rows[-1] == {
        "step": 2.0,
        "eval/accuracy": 0.75,
        "eval/accuracy_std": 0.1,
        "eval/rollouts_total": 32.0,
    }


def test_a_restarted_run_directory_continues_the_same_wandb_run(tmp_path: Path, offline) -> None:
    first = WandbSink(offline, tmp_path, {})
    first.write("train", {"step": 1, "reward_mean": 0.1})
    first.close()
    run_id = (tmp_path / WANDB_DIR / "run_id").read_text().strip()
    again = WandbSink(offline, tmp_path, {})
    again.write("train", {"step": 1, "reward_mean": 0.2})  # a step trained again after resume
    again.close()
    runs = sorted((tmp_path / WANDB_DIR).glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in run.name for run in runs)
    (resumed,) = runs[1].glob("run-*.wandb")
    assert history(resumed, 1) == [{"step": 1.0, "train/reward_mean": 0.2}]


def test_the_recipe_chooses_the_sinks(tmp_path: Path, offline) -> None:
    config = load_run_config(
        REPO / "examples" / "cpu_demo.yaml",
        ["report.tensorboard=false", "report.wandb={mode: offline, project: p}"],
    )
    wandb = WandbConfig(project="p", mode="offline")
    assert config.report == ReportConfig(tensorboard=False, wandb=wandb)
    sinks = build_sinks(config.report, tmp_path, {})
    assert [type(sink).__name__ for sink in sinks] == ["WandbSink"]
    sinks[0].close()
    default = build_sinks(ReportConfig(), tmp_path / "default", {})
    assert [type(sink).__name__ for sink in default] == ["TensorBoardSink"]
    default[0].close()
    with pytest.raises(ValueError, match="mode"):
        load_run_config(REPO / "examples" / "cpu_demo.yaml", ["report.wandb={mode: sometimes}"])
