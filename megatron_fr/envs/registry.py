"""Environments by name: the swappable part of a task, one module each.

    task: {name: python_tool, env: {sandbox: {wall_timeout_s: 5}}}      # a recipe
    environment = build_environment("python_tool", {"sandbox": {"wall_timeout_s": 5}})

An environment is an Environment subclass (envs/base.py) with a `name`, a `Config` (the
pydantic model of its `task.env` settings) and, for multi-turn play, `agent` defaults. It is
found, in this order, by:
    - its name among the built-ins below (imported only when a recipe names it, so a math run
      never imports ALFWorld);
    - its name among the entry points of group "megatron_fr.environments" of any installed
      package (`[project.entry-points."megatron_fr.environments"] my_env = "pkg.mod:MyEnv"`);
    - an import path "package.module:Class" written as the task's name.
Adding an environment is therefore one module plus one line (here, or in the package's own
metadata), and tests/unit/test_environment_contract.py checks every built-in against the
interface.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ValidationError

from megatron_fr.config.base import describe
from megatron_fr.envs.base import Environment

BUILTIN: dict[str, str] = {
    "math": "megatron_fr.envs.math_env:MathEnvironment",
    "python_tool": "megatron_fr.envs.python_tool:PythonToolEnvironment",
    "alfworld": "megatron_fr.envs.alfworld:AlfWorldEnvironment",
    "textworld": "megatron_fr.envs.alfworld:TextWorldEnvironment",
}
ENTRY_POINT_GROUP = "megatron_fr.environments"


class UnknownEnvironment(ValueError):
    """The task names no environment that can be found or imported."""


def known_names() -> list[str]:
    """Every registered name: the built-ins and the installed entry points."""
    return sorted({*BUILTIN, *(point.name for point in entry_points(group=ENTRY_POINT_GROUP))})


def environment_class(name: str) -> type[Environment]:
    """The Environment subclass `name` stands for (see the module doc for the search order)."""
    target = BUILTIN.get(name)
    if target is None:
        points = [p for p in entry_points(group=ENTRY_POINT_GROUP) if p.name == name]
        target = points[0].value if points else name
    if ":" not in target:
        raise UnknownEnvironment(
            f"task.name: unknown environment {name!r}; registered: {known_names()}, or give "
            "an import path 'package.module:Class'"
        )
    module_name, _, attribute = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise UnknownEnvironment(f"task.name: cannot import {target!r} ({error})") from None
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise UnknownEnvironment(f"task.name: {target!r} is not an Environment subclass")
    return found


def environment_config(name: str, options: dict[str, Any] | None = None) -> BaseModel:
    """`options` validated by the environment's Config; ValueError naming task.env's key."""
    cls = environment_class(name)
    try:
        return cls.Config.model_validate(options or {})
    except ValidationError as error:
        raise ValueError(f"environment {name!r}: {describe(error, 'task.env.')}") from None


def build_environment(name: str, options: dict[str, Any] | None = None) -> Environment:
    """The environment registered as `name`, configured by `options`."""
    return environment_class(name)(environment_config(name, options))
