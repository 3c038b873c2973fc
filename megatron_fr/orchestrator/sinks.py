"""Where a run's metric lines go besides metrics.jsonl (the source of truth): TensorBoard
scalars, and a Weights & Biases run. One class per sink, chosen by the run's `report` config.

    sink.write("train", {"step": 3, "reward_mean": 0.4, ...})   # every numeric key but step
    sink.write("eval", {"step": 3, "eval_accuracy": 0.7, ...})  # tags drop the eval_ prefix
    sink.close()
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Protocol

from megatron_fr.analysis.run_files import is_number
from megatron_fr.config.report import ReportConfig, WandbConfig

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"


class MetricSink(Protocol):
    def write(self, scope: str, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(scope: str, metrics: dict[str, Any]) -> dict[str, float]:
    """{scope/name: value} for every numeric key but step (eval lines drop `eval_`)."""
    return {
        f"{scope}/{key.removeprefix('eval_') if scope == 'eval' else key}": value
        for key, value in metrics.items()
        if key != "step" and is_number(value)
    }


class TensorBoardSink:
    """RUN_DIR/tensorboard, each scalar at global_step = the line's step."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def write(self, scope: str, metrics: dict[str, Any]) -> None:
        for tag, value in scalars(scope, metrics).items():
            self._writer.add_scalar(tag, value, global_step=metrics["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run, resumed across restarts of the same run directory (its id is kept in
    RUN_DIR/wandb/run_id). Every line carries `step` and is plotted against it
    (define_metric), not against W&B's own counter, so the steps a resumed run trains
    again after its checkpoint are logged again rather than refused as going backwards."""

    def __init__(self, config: WandbConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ValueError("report.wandb needs the wandb package: pip install wandb") from None
        directory = Path(run_dir) / WANDB_DIR
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / "run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or Path(run_dir).name,
            tags=list(config.tags),
            mode=config.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=run_config,
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, scope: str, metrics: dict[str, Any]) -> None:
        self._run.log({"step": metrics["step"], **scalars(scope, metrics)})

    def close(self) -> None:
        self._run.finish()


def build_sinks(config: ReportConfig, run_dir: Path, run_config: dict[str, Any]) -> list:
    """The sinks `config` asks for."""
    sinks: list[MetricSink] = []
    if config.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if config.wandb is not None:
        sinks.append(WandbSink(config.wandb, run_dir, run_config))
    return sinks
