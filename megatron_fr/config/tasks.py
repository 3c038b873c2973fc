"""What a run trains on: prompt files played through an environment, one row per episode.

    task:
      name: python_tool          # the environment: a registered name (envs/registry.py:
                                 # math, python_tool, alfworld, textworld) or an import path
                                 # "package.module:EnvironmentClass" of one's own
      env: {sandbox: {...}}      # that environment's own settings, validated by its Config
      train: {path: data/train.jsonl}
      eval_sets: {aime24: {path: data/aime24.parquet, samples: 16}}
      agent: {max_turns: 20}     # multi-turn limits; absent: the environment's own defaults
                                 # (one turn for math)

The settings every task shares are typed here; an environment's own (`env`) are validated by
the environment's config class when the run is checked, before any process starts
(orchestrator/tasks.py), so adding an environment never touches this file. Imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from megatron_fr.config.base import Seconds, StrictModel
from megatron_fr.config.data import DatasetConfig


class AgentConfig(StrictModel):
    """Limits of one episode of the agent loop (rollout/agent.py)."""

    max_turns: PositiveInt = 8
    """Policy turns (generate calls) per episode."""
    max_new_tokens_per_turn: PositiveInt = 1024
    """Tokens the policy may generate in one turn."""
    max_episode_tokens: PositiveInt = 8192
    """Length of the whole row: prompt, every turn, every observation."""
    max_turn_time_s: Seconds = 300.0
    """Wall time of one generation (server queueing included)."""
    max_episode_time_s: Seconds = 1800.0
    """Wall time of the whole episode, environment steps included."""
    max_observation_chars: PositiveInt = 8192
    """Each observation message is cut to this many characters before it is tokenised."""


class EvalSetConfig(DatasetConfig):
    """A held-out set: a prompt file, and k of its avg@k."""

    samples: PositiveInt | None = None
    """k of avg@k for this set (None: eval.samples)."""


class TaskConfig(StrictModel):
    """The environment, its prompt files, and the lengths and truncation rules of a row."""

    name: str = Field(min_length=1)
    """The environment: a name registered in envs/registry.py, or "package.module:Class" (an
    Environment subclass with its own Config) for one of your own."""
    env: dict[str, Any] = Field(default_factory=dict)
    """The environment's own settings (its Config class validates them)."""
    train: DatasetConfig
    """The training prompts (a file and which of its fields hold what)."""
    eval_sets: dict[str, EvalSetConfig] = Field(default_factory=dict)
    """Named held-out sets, each evaluated as avg@k (metrics eval_<name>_accuracy)."""
    agent: AgentConfig | None = None
    """Multi-turn limits. None: the environment's defaults (its `agent` class attribute); an
    environment without any plays one turn of at most max_new_tokens."""
    max_prompt_tokens: PositiveInt = 1024
    """Samples whose rendered prompt is longer are dropped when the data is loaded (counted)."""
    max_new_tokens: PositiveInt = 1024
    """Most generated tokens of one turn."""
    truncated: Literal["reward", "penalty", "mask"] = "reward"
    """A response cut by a length limit: "reward" scores it as it is; "penalty" adds DAPO's
    soft overlong penalty; "mask" leaves it out of the loss (it still counts in B)."""
    overlong_buffer_tokens: NonNegativeInt = 0
    """DAPO's soft window: past max - buffer, the penalty grows linearly to its full size."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Full size of that penalty (subtracted from the reward)."""

    def single_turn_agent(self) -> AgentConfig:
        """The limits of a one-turn episode: the prompt and one response of max_new_tokens."""
        return AgentConfig(
            max_turns=1,
            max_new_tokens_per_turn=self.max_new_tokens,
            max_episode_tokens=self.max_prompt_tokens + self.max_new_tokens,
        )
