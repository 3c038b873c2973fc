"""Verifiable tasks: problems to prompt with, and an exact reward for what the policy wrote.

A task works in token ids end to end (prompt ids in, generated ids scored), so rollouts,
rewards and the supervised warm start need no tokenizer. Tasks are chosen by `task.name` in
the run config (config/tasks.py).
"""

from __future__ import annotations

import random
from typing import Protocol

from pydantic import BaseModel

from megatron_fr.tasks.arithmetic import ArithmeticConfig, ArithmeticTask, Problem


class Task(Protocol):
    """What the warm start and the RL loop need from a task."""

    name: str
    config: BaseModel
    pad_id: int
    stop_token_ids: tuple[int, ...]

    @property
    def max_new_tokens(self) -> int: ...

    def problems(self, split: str, count: int, seed: int | None = None) -> list[Problem]: ...

    def target_ids(self, problem: Problem) -> list[int]: ...

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]: ...

    def reward(self, problem: Problem, output_ids: list[int]) -> float: ...


def build_task(config: ArithmeticConfig) -> Task:
    """The token-level task a run's `task` settings describe (`arithmetic`)."""
    return ArithmeticTask(config)


__all__ = ["ArithmeticConfig", "ArithmeticTask", "Problem", "Task", "build_task"]
