"""What a run trains on: a typed choice of task, keyed on `task.name`.

    arithmetic    the token-level toy (no tokenizer): the smoke recipe
    math          one turn; prompts from a dataset file; the reward is math-verify on the
                  \\boxed{} answer (envs/math_env.py)
    python_tool   multi-turn; the model calls a Python sandbox; the final answer is graded
    alfworld      multi-turn; ALFWorld games (or TextWorld games behind the same interface)
    textworld     multi-turn; TextWorld games generated offline

Text tasks share the dataset, length and eval settings below; the multi-turn ones add the
agent loop's limits (AgentConfig) and their environment's own config. Every field has its
default here and nowhere else. Imports no torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt

from megatron_fr.envs.alfworld import AlfWorldConfig
from megatron_fr.envs.datasets import DatasetConfig
from megatron_fr.envs.math_env import MathEnvConfig
from megatron_fr.envs.python_tool import PythonToolConfig
from megatron_fr.tasks.arithmetic import ArithmeticConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AgentConfig(_Strict):
    """Limits of one episode of the agent loop (rollout/agent.py)."""

    max_turns: PositiveInt = 8
    """Policy turns (generate calls) per episode."""
    max_new_tokens_per_turn: PositiveInt = 1024
    max_episode_tokens: PositiveInt = 8192
    """Length of the whole row: prompt, every turn, every observation."""
    max_turn_time_s: PositiveFloat = 300.0
    """Wall time of one generation (server queueing included)."""
    max_episode_time_s: PositiveFloat = 1800.0
    """Wall time of the whole episode, environment steps included."""
    max_observation_chars: PositiveInt = 8192
    """Each observation message is cut to this many characters before it is tokenised."""


class EvalSetConfig(DatasetConfig):
    """A held-out set: a prompt file, and k of its avg@k."""

    samples: PositiveInt | None = None
    """k of avg@k for this set (None: eval.samples)."""


class _TextTask(_Strict):
    """Settings every text task shares."""

    train: DatasetConfig
    """The training prompts (a file and which of its fields hold what)."""
    eval_sets: dict[str, EvalSetConfig] = Field(default_factory=dict)
    """Named held-out sets, each evaluated as avg@k (metrics eval_<name>_accuracy)."""
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


class ArithmeticTask(ArithmeticConfig):
    """The token-level toy (tasks/arithmetic.py): its own vocabulary, no tokenizer."""

    name: Literal["arithmetic"] = "arithmetic"


class MathTask(_TextTask):
    name: Literal["math"]
    env: MathEnvConfig = MathEnvConfig()


class PythonToolTask(_TextTask):
    name: Literal["python_tool"]
    env: PythonToolConfig = PythonToolConfig()
    agent: AgentConfig = AgentConfig()


class AlfWorldTask(_TextTask):
    name: Literal["alfworld"]
    env: AlfWorldConfig = AlfWorldConfig()
    agent: AgentConfig = AgentConfig(max_turns=50)


class TextWorldTask(_TextTask):
    """TextWorld games (specs generated offline with tw-make, or game files) played through
    the same environment as ALFWorld."""

    name: Literal["textworld"]
    env: AlfWorldConfig = AlfWorldConfig()
    agent: AgentConfig = AgentConfig(max_turns=20)


TaskSettings = Annotated[
    ArithmeticTask | MathTask | PythonToolTask | AlfWorldTask | TextWorldTask,
    Field(discriminator="name"),
]
TEXT_TASKS = (MathTask, PythonToolTask, AlfWorldTask, TextWorldTask)
