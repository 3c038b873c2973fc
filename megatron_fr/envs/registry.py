"""Environments by name: the swappable part of an agent recipe.

    env = build_environment("python_tool", {"sandbox": {"wall_timeout_s": 5}})

Each name maps to its Environment class and its typed config (options are validated by it).
"""

from __future__ import annotations

from pydantic import BaseModel

from megatron_fr.envs.alfworld import AlfWorldConfig, AlfWorldEnvironment
from megatron_fr.envs.base import Environment
from megatron_fr.envs.math_env import MathEnvConfig, MathEnvironment
from megatron_fr.envs.python_tool import PythonToolConfig, PythonToolEnvironment

ENVIRONMENTS: dict[str, type[Environment]] = {
    MathEnvironment.name: MathEnvironment,
    PythonToolEnvironment.name: PythonToolEnvironment,
    AlfWorldEnvironment.name: AlfWorldEnvironment,
}
CONFIGS: dict[str, type[BaseModel]] = {
    MathEnvironment.name: MathEnvConfig,
    PythonToolEnvironment.name: PythonToolConfig,
    AlfWorldEnvironment.name: AlfWorldConfig,
}


def build_environment(name: str, options: dict | None = None) -> Environment:
    """The environment registered as `name`, configured by `options`."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](CONFIGS[name](**(options or {})))
