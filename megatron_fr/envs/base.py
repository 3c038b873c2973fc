"""The interface between the agent loop and an environment.

    env = build_environment("python_tool", options)      # envs/registry.py; shared by many
                                                         # episodes, thread-safe
    episode = env.start(sample)                          # one conversation's state
    episode.messages, episode.tools                      # what the policy is prompted with
    result = episode.step(assistant_text)                # the policy's whole turn, as text
      ─► StepResult(messages=observations to append, reward, done, info)
    episode.close()

An environment works in text and chat messages, never in tokens: the agent loop owns the chat
template and the tokenizer, so every environment works with every model. The loop calls
`step` from a worker thread (steps may block: a sandbox run, a grader), one step at a time per
episode; different episodes' steps may run concurrently on one Environment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from megatron_fr.config.tasks import AgentConfig

Message = dict[str, str]
"""A chat message: {"role": "system" | "user" | "assistant" | "tool", "content": str}."""
Sample = dict[str, Any]
"""One row of a prompt file; "id" is always present (datasets.load_samples sees to it)."""


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one policy turn."""

    messages: list[Message] = field(default_factory=list)
    """Observations appended to the conversation as non-policy tokens (empty when done)."""
    reward: float = 0.0
    """Reward of this step; the episode's reward is the sum over its steps."""
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable facts about the step (kept in the trajectory's info)."""


class Episode(ABC):
    """One conversation with an environment."""

    messages: list[Message]
    """The conversation the policy starts from (system and user messages)."""
    tools: list[dict[str, Any]] | None = None
    """JSON schemas of the tools the policy may call, for the chat template's `tools`."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """React to the policy's turn (its text, without the end-of-turn token)."""

    def close(self) -> None:  # noqa: B027  (most episodes hold nothing to release)
        """Release what the episode holds (a game process...)."""


class Environment(ABC):
    """Makes episodes from samples; owns what they share (a grader pool, a sandbox).
    Constructed as ``EnvironmentClass(EnvironmentClass.Config(**task_env))``."""

    name: ClassVar[str]
    """The name recipes use (task.name) and the registry knows it by."""
    Config: ClassVar[type[BaseModel]]
    """Its settings (a recipe's task.env), validated before any process starts."""
    agent: ClassVar[AgentConfig | None] = None
    """Default limits of a multi-turn episode (a recipe's task.agent replaces them); None:
    the environment is played one turn at a time (one response of task.max_new_tokens)."""

    @abstractmethod
    def __init__(self, config: BaseModel) -> None:
        """From its own Config, validated (registry.build_environment builds it so)."""

    @abstractmethod
    def start(self, sample: Sample) -> Episode:
        """A fresh episode for `sample`."""

    def close(self) -> None:  # noqa: B027
        """Release shared resources (worker processes)."""

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
