"""A training run: one typed config, loaded from a recipe file with dotted overrides.

    megatron-fr train examples/cpu_demo.yaml --run-dir runs/demo learner.lr=2e-4 steps=40

Overrides are ``dotted.key=value`` with the value read as YAML (numbers, booleans, lists), so
a recipe and the command line say things the same way. The fully resolved config is written
into the run directory (config.yaml); a restart with the same command resumes the run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from megatron_fr.config.base import StrictModel, describe
from megatron_fr.config.buffer import BufferConfig
from megatron_fr.config.cluster import ClusterSettings
from megatron_fr.config.engine_kinds import capabilities
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.config.report import ReportConfig
from megatron_fr.config.rollout import EvalSettings, RolloutSettings
from megatron_fr.config.tasks import TaskConfig
from megatron_fr.config.weights import WeightSyncConfig


class ModelSettings(StrictModel):
    hf_dir: str = Field(min_length=1)
    """The starting HF checkpoint: config.json, safetensors, the tokenizer with its chat
    template (and generation_config.json, where the model says when to stop). Relative to
    the recipe file when written in one. The CPU demos' tiny models are made by
    `megatron-fr demo prepare RECIPE` (megatron_fr/demo/)."""
    spec: Literal["te", "torch", "local"] | None = None
    """The learner's megatron layer spec (models/gpt.py): te, transformer-engine's; torch,
    megatron's local spec on torch's fused attention and grouped-GEMM experts (no TE needed);
    local, megatron's local spec (the reference). None: te where transformer-engine imports,
    else torch on a GPU, else local. Every spec reads and writes the same checkpoints."""


class CheckpointSettings(StrictModel):
    every_steps: int = Field(default=10, ge=1)
    """A checkpoint every this many steps (and at the last step and on a STOP request)."""
    keep: int = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""


class RunConfig(StrictModel):
    steps: int = Field(ge=1)
    """Optimizer steps (policy versions) to train."""
    seed: int = 0
    """Seeds the learner's random state, the order prompts are handed out in, and the
    engines' sampling (their sampling_seed)."""
    learner_ranks: int = Field(default=1, ge=1)
    """Learner processes on each learner node (torchrun --nproc-per-node; `megatron-fr
    train` started by hand runs them on this one); the world is cluster.learner_nodes x
    learner_ranks. Under an existing torchrun/srun launch the environment decides."""
    cluster: ClusterSettings = ClusterSettings()
    """The nodes the recipe is laid out for (config/cluster.py)."""
    model: ModelSettings
    task: TaskConfig
    parallel: ParallelConfig = ParallelConfig()
    learner: LearnerConfig = LearnerConfig()
    buffer: BufferConfig
    rollout: RolloutSettings = RolloutSettings()
    weights: WeightSyncConfig = WeightSyncConfig()
    eval: EvalSettings = EvalSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()
    report: ReportConfig = ReportConfig()

    @property
    def learner_world(self) -> int:
        """The learner ranks the recipe is laid out for: cluster.learner_nodes x
        learner_ranks."""
        return self.cluster.learner_nodes * self.learner_ranks

    @model_validator(mode="after")
    def _ranks_fit_the_nodes(self) -> RunConfig:
        gpus = self.cluster.gpus_per_node
        if gpus and self.learner_ranks > gpus:
            raise ValueError(
                f"learner_ranks {self.learner_ranks} (per learner node) is more than "
                f"cluster.gpus_per_node {gpus}"
            )
        server = self.cluster.server_gpus
        if server and gpus and gpus % server:
            raise ValueError(
                f"cluster.server_gpus {server} does not divide cluster.gpus_per_node {gpus}"
            )
        return self

    @model_validator(mode="after")
    def _estimator_fits_group_size(self) -> RunConfig:
        grouped = self.learner.estimator != "flash_reinforce"
        if grouped and self.buffer.group_size < 2:
            raise ValueError(
                f"estimator {self.learner.estimator!r} needs buffer.group_size >= 2 "
                "(rollouts per problem)"
            )
        return self

    @model_validator(mode="after")
    def _engines_can_serve_it(self) -> RunConfig:
        """What the recipe's engine kind cannot serve (its row of config/engine_kinds.py),
        refused before anything starts rather than at the first request."""
        kind = self.rollout.engine.kind
        engine = capabilities(kind)
        weights = self.weights
        refused = {
            "learner.routing_replay": (
                self.learner.routing_replay and not engine.routed_experts,
                f"the routed experts are not read from {engine.name}",
            ),
            "learner.flash_reinforce.gate_kl=topk": (
                self.learner.flash_reinforce.gate_kl == "topk" and not engine.top_logprobs,
                f"top-K log-probs are not read from {engine.name}; use gate_kl bernoulli",
            ),
            f"weights.pause_mode={weights.pause_mode}": (
                weights.pause_mode not in engine.pause_modes,
                f"{engine.name} has no such pause; use {' or '.join(engine.pause_modes)}",
            ),
            "weights.spot_check": (
                weights.spot_check > 0 and engine.weight_readback == "none",
                f"{engine.name} has no route to read weights back; the sync check "
                "(verify_every) checks its log-probs",
            ),
            f"weights.transport={weights.transport}": (
                weights.transport not in engine.weight_transports,
                f"{engine.name} engines receive weights by "
                f"{' or '.join(engine.weight_transports)} only",
            ),
        }
        for name, (given, why) in refused.items():
            if given:
                raise ValueError(f"rollout.engine.kind {kind} with {name}: {why}")
        return self

    @model_validator(mode="after")
    def _deadlines_below_the_collective_timeout(self) -> RunConfig:
        """While the first rank waits out one of these deadlines the other ranks wait for it
        in collectives (in slices, but a single call to an engine is not sliced), and a
        collective that reaches parallel.timeout_minutes kills the job through the
        watchdog: each deadline must end before it."""
        collective_s = self.parallel.timeout_minutes * 60
        deadlines = {
            "eval.timeout_s": self.eval.timeout_s,
            "rollout.engine.start_timeout_s": self.rollout.engine.start_timeout_s,
            "weights.timeout_s": self.weights.timeout_s,
            "weights.regroup_timeout_s": self.weights.regroup_timeout_s,
        }
        for name, seconds in deadlines.items():
            if seconds >= collective_s:
                raise ValueError(
                    f"{name}={seconds:g} s reaches parallel.timeout_minutes="
                    f"{self.parallel.timeout_minutes} ({collective_s:g} s): the other ranks "
                    "would be killed by the collective timeout while the first rank waits; "
                    f"lower {name} or raise parallel.timeout_minutes"
                )
        return self


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    one silently, so a recipe would not say what it runs) and a key that is not a string (a
    list or a number as a setting's name), and reading `1e-5` as the float it is (YAML 1.2;
    PyYAML's 1.1 rules read an exponent without a dot as a string, which the strict settings
    then refuse)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {str(key)[:60]!r} is not a setting's name (a string)",
                    key_node.start_mark,
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> object:
    """`text` as YAML (safe, no duplicate or non-string keys, YAML 1.2 exponents);
    yaml.YAMLError, or RecursionError for nesting deeper than the parser can follow."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of data with each ``a.b.c=value`` set (value parsed as YAML)."""
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override {override!r} is not of the form dotted.key=value")
        try:
            value = parse_yaml(text)
        except (yaml.YAMLError, RecursionError) as error:
            problem = getattr(error, "problem", None) or error
            raise ValueError(f"override {override!r}: the value is not YAML ({problem})") from None
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {override!r}: {part!r} is not a section")
        node[leaf] = value
    return data


def read_recipe(recipe: str | Path) -> dict:
    """The recipe file's mapping; FileNotFoundError / ValueError naming the file and, for bad
    YAML, the line and column."""
    path = Path(recipe)
    if not path.exists():
        raise FileNotFoundError(f"recipe {path} not found")
    if not path.is_file():
        raise ValueError(
            f"recipe {path} is not a file (a YAML recipe, e.g. examples/cpu_demo.yaml)"
        )
    try:
        data = parse_yaml(path.read_text())
    except RecursionError:
        raise ValueError(f"recipe {path}: nested deeper than YAML can be read") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or error
        raise ValueError(f"recipe {path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"recipe {path}: not a text file ({error})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: the top level must be a mapping of settings")
    return data


def load_run_config(recipe: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The recipe with the overrides applied. Paths written in a recipe (prompt files, the
    model directory) are relative to the recipe file, so a recipe and its data travel
    together; paths given as overrides are relative to the working directory, as on any
    command line."""
    data = _resolve_paths(read_recipe(recipe), Path(recipe).resolve().parent)
    try:
        return RunConfig.model_validate(apply_overrides(data, list(overrides)))
    except ValidationError as error:
        raise ValueError(f"recipe {recipe}: {describe(error)}") from None


def _resolve_paths(data: dict, base: Path) -> dict:
    task, model = data.get("task"), data.get("model")
    holders: list[object] = [model] if isinstance(model, dict) else []
    if isinstance(task, dict):
        eval_sets = task.get("eval_sets")
        holders += [task.get("train"), *(eval_sets.values() if isinstance(eval_sets, dict) else [])]
    for holder in holders:
        for key in ("path", "hf_dir"):
            if isinstance(holder, dict) and isinstance(holder.get(key), str):
                path = Path(holder[key]).expanduser()
                holder[key] = os.path.normpath(path if path.is_absolute() else base / path)
    return data
