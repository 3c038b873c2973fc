"""Where a run's numbers go besides metrics.jsonl: TensorBoard, and optionally Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_fr.config.base import StrictModel, StrictTuple


class WandbConfig(StrictModel):
    """A Weights & Biases run mirroring metrics.jsonl (the `wandb` package must be installed)."""

    project: str = Field(default="megatron-fr", min_length=1)
    """The Weights & Biases project the run logs to."""
    entity: str | None = None
    """The team or user; None: the logged-in default."""
    name: str | None = None
    """The run's display name; None: the run directory's name."""
    tags: StrictTuple[str] = ()
    """Tags of the run on Weights & Biases."""
    mode: Literal["online", "offline"] = "online"
    """offline: written under RUN_DIR/wandb only (no network), to `wandb sync` later."""


class ReportConfig(StrictModel):
    """The metric sinks of the first learner rank (orchestrator/run_log.py)."""

    tensorboard: bool = True
    """Scalars under RUN_DIR/tensorboard."""
    wandb: WandbConfig | None = None
    """None: no W&B run. A resumed run continues the same W&B run (its id is kept in
    RUN_DIR/wandb/run_id), every line keyed by its `step`."""
