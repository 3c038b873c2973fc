"""Typed settings of a simulated run: cluster, inference servers, learner, weight sync,
response lengths and the buffer. Each field's docstring is its --help line
(tools/simulate_run.py lists them all with their defaults).

Defaults marked "assumption" are placeholders for a Qwen3-30B-A3B run on H100 nodes, not
measurements: calibrate them from a run (simulate_run.py --validate RUN_DIR) or a benchmark
before trusting absolute figures. Ratios between schemes and the shape of a sweep depend on
them much less than absolute trajectories per hour do.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from megatron_fr.config.run import apply_overrides


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ClusterSettings(_Section):
    """Nodes of the run: rollout nodes hold inference servers, learner nodes the learner."""

    rollout_nodes: PositiveInt = 2
    """Nodes running inference servers."""
    learner_nodes: PositiveInt = 2
    """Nodes running learner ranks (one per GPU)."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node, rollout and learner nodes alike."""


class ServerSettings(_Section):
    """One inference server and its batching model (megatron_fr/sim/costs.py DecodeModel).

    A decode iteration over c running requests takes t(c) = t0 + t1 * c seconds and gives each
    of them one token, so one request decodes at 1 / t(c) tokens/s and the server at
    c / t(c), which saturates at 1 / t1. t0 and t1 come from the two rates below:
    t1 = 1 / peak_tokens_per_s, t0 = 1 / single_stream_tokens_per_s - t1.
    """

    gpus_per_server: PositiveInt = 4
    """GPUs of one server (its tensor-parallel size); it must divide gpus_per_node."""
    single_stream_tokens_per_s: PositiveFloat = 120.0
    """Decode speed of a request running alone (assumption)."""
    peak_tokens_per_s: PositiveFloat = 6000.0
    """Decode tokens/s of the whole server at saturation (assumption)."""
    max_running_requests: PositiveInt = 256
    """Requests a server decodes at once; further ones wait in its queue (SGLang's
    --max-running-requests, standing in for the KV-cache limit)."""
    prefill_tokens_per_s: PositiveFloat | None = None
    """Prefill speed; while a server prefills a request (its prompt, or prompt + tokens so far
    when a request continues after a weight sync) it decodes nothing. None: prefill is free."""

    @model_validator(mode="after")
    def _single_not_above_peak(self) -> ServerSettings:
        if self.single_stream_tokens_per_s > self.peak_tokens_per_s:
            raise ValueError(
                f"server.single_stream_tokens_per_s ({self.single_stream_tokens_per_s}) must be "
                f"<= server.peak_tokens_per_s ({self.peak_tokens_per_s}): batching never slows a "
                "server down"
            )
        return self


class LearnerSettings(_Section):
    """Learner step time: training FLOPs of the batch / (GPUs x peak x MFU) + overhead."""

    model: str = "qwen3-30b-a3b"
    """Model preset (megatron_fr/models/presets), HF checkpoint directory or config.json."""
    peak_tflops_per_gpu: PositiveFloat = 989.0
    """Dense bf16 peak of one GPU (H100 SXM datasheet: 989 TFLOP/s without sparsity)."""
    mfu: float = Field(default=0.2, gt=0, le=1)
    """Model FLOPs utilisation: model FLOPs (6 x active parameters per token, plus causal
    attention) over peak (assumption: ~200 TFLOP/s/GPU on H100, the figure reported for
    Qwen3-30B-A3B training with megatron)."""
    step_overhead_s: NonNegativeFloat = 0.0
    """Fixed time per step on top of the FLOPs (optimizer step, batch broadcast)."""
    seconds_per_step: PositiveFloat | None = None
    """A measured step time (training only, without the sync); replaces the FLOPs model."""
    gpu_mem_gb: PositiveFloat | None = 80.0
    """GPU memory in GiB, for --suggest to skip splits whose learner nodes cannot hold the
    model (launch/plan.py); None: no such check."""
    micro_batch_tokens: PositiveInt = 16384
    """Tokens per micro-batch per rank, for that memory check."""


class SyncSettings(_Section):
    """Weight sync after each step: seconds = latency_s + bytes / (bandwidth_gb_s * 1e9)."""

    bandwidth_gb_s: PositiveFloat = 25.0
    """Effective broadcast bandwidth from the learner to every server, GB/s (assumption)."""
    latency_s: NonNegativeFloat = 2.0
    """Fixed cost per sync: pause, resharding set-up, version set, continue (assumption)."""
    bytes: NonNegativeInt | None = None
    """Bytes sent per sync; None: the model's parameters in bf16 (2 bytes each)."""


class LengthSettings(_Section):
    """Tokens per trajectory: a prompt and a long-tailed response."""

    median_tokens: PositiveFloat = 2048.0
    """Median response length of the lognormal (assumption)."""
    sigma: NonNegativeFloat = 1.0
    """Standard deviation of log(response length): the tail (assumption)."""
    max_new_tokens: PositiveInt = 14336
    """Responses are cut here (the paper's Qwen3-30B-A3B tool setting generates up to 14,336)."""
    prompt_tokens: NonNegativeInt = 512
    """Prompt length of every trajectory when the lengths file gives none."""
    file: str | None = None
    """JSONL of measured lengths, one object per line with response_tokens (and optionally
    prompt_tokens); rollouts draw from it with replacement instead of the lognormal."""


class SchemeSettings(_Section):
    """Batching and staleness of the two schemes compared."""

    batch_size: PositiveInt = 128
    """B: trajectories per optimizer step (both schemes)."""
    max_lag: NonNegativeInt = 8
    """FlashREINFORCE's staleness bound (buffer.max_lag); GRPO runs synchronously (lag 0)."""
    capacity: PositiveInt | None = None
    """FlashREINFORCE's buffer capacity; None: (max_lag + 1) * batch_size."""
    max_in_flight: PositiveInt | None = None
    """FlashREINFORCE's buffer.max_in_flight; None: no extra bound."""
    stale_policy: Literal["drop_trajectory", "mask_stale_tokens"] = "drop_trajectory"
    """FlashREINFORCE's buffer.stale_policy: a rollout as old as its first token
    (drop_trajectory) or as its last (mask_stale_tokens) when the buffer decides to drop it."""
    grpo_group_size: PositiveInt = 8
    """G: GRPO rollouts per prompt; a batch is batch_size / G whole groups."""

    @model_validator(mode="after")
    def _groups_fill_batches(self) -> SchemeSettings:
        if self.batch_size % self.grpo_group_size:
            raise ValueError(
                f"scheme.batch_size ({self.batch_size}) must be a multiple of "
                f"scheme.grpo_group_size ({self.grpo_group_size}): a batch holds whole groups"
            )
        return self


class SimConfig(_Section):
    """Everything one simulation needs."""

    cluster: ClusterSettings = ClusterSettings()
    server: ServerSettings = ServerSettings()
    learner: LearnerSettings = LearnerSettings()
    sync: SyncSettings = SyncSettings()
    lengths: LengthSettings = LengthSettings()
    scheme: SchemeSettings = SchemeSettings()
    steps: PositiveInt = 120
    """Optimizer steps simulated."""
    warmup_steps: NonNegativeInt = 20
    """Steps left out of every reported figure (the buffer filling up)."""
    seed: int = 0
    """Seed of the response lengths; the same seed gives the same figures."""

    @model_validator(mode="after")
    def _consistent(self) -> SimConfig:
        if self.cluster.gpus_per_node % self.server.gpus_per_server:
            raise ValueError(
                f"server.gpus_per_server ({self.server.gpus_per_server}) must divide "
                f"cluster.gpus_per_node ({self.cluster.gpus_per_node})"
            )
        if self.warmup_steps >= self.steps:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps}): "
                "nothing would be measured"
            )
        return self

    @property
    def servers(self) -> int:
        return (
            self.cluster.rollout_nodes * self.cluster.gpus_per_node // self.server.gpus_per_server
        )

    @property
    def learner_gpus(self) -> int:
        return self.cluster.learner_nodes * self.cluster.gpus_per_node

    def with_split(self, rollout_nodes: int, learner_nodes: int) -> SimConfig:
        cluster = self.cluster.model_copy(
            update={"rollout_nodes": rollout_nodes, "learner_nodes": learner_nodes}
        )
        return self.model_copy(update={"cluster": cluster})


def load_sim_config(path: str | Path | None, overrides: list[str]) -> SimConfig:
    """Settings from an optional YAML file, then dotted key=value overrides (values read as
    YAML, as for `megatron-fr train`). ValueError names the file or key at fault."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"simulator config {path} not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"simulator config {path}: expected a mapping at the top level")
    return SimConfig.model_validate(apply_overrides(data, overrides))


def field_help(model: type[BaseModel] = SimConfig, prefix: str = "") -> list[str]:
    """One line per settable key, `dotted.key = default: docstring`, for --help."""
    lines = []
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.extend(field_help(annotation, f"{prefix}{name}."))
            continue
        text = f"{prefix}{name} = {info.default!r}: {' '.join((info.description or '').split())}"
        lines.extend(textwrap.wrap(text, width=98, initial_indent="  ", subsequent_indent="      "))
    return lines
