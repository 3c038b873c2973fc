"""The "math" environment: one turn, the reward is 1.0 iff the final answer is equivalent to
the reference (math_grader: extraction + math-verify under a deadline).

Samples: {"id", "problem", "answer"} (JSONL or parquet; data/math.jsonl is bundled).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field

from megatron_fr.config.base import StrictModel
from megatron_fr.envs.base import Environment, Episode, Sample, StepResult
from megatron_fr.envs.math_grader import MathGrader, MathGraderConfig

DEFAULT_INSTRUCTION = "Solve the problem. Put your final answer within \\boxed{}."


class MathEnvConfig(StrictModel):
    grader: MathGraderConfig = Field(default_factory=MathGraderConfig)
    system_prompt: str | None = None
    """A system message before the problem (None: none)."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended to the problem in the user message."""


def math_messages(sample: Sample, system_prompt: str | None, instruction: str) -> list[dict]:
    """The opening conversation for a problem sample (shared with python_tool). A sample that
    carries its own chat messages (a verl-style `prompt`, with its own instruction on how to
    state the answer) opens with them as they are; otherwise the problem and `instruction`
    make the user turn. `system_prompt` comes first when the messages have none."""
    for key in ("problem", "answer"):
        if not isinstance(sample.get(key), str | int | float):
            raise ValueError(f"sample {sample.get('id')!r} needs a {key!r} field")
    if sample.get("messages"):
        messages = list(sample["messages"])
    else:
        messages = [{"role": "user", "content": f"{sample['problem']}\n\n{instruction}"}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


class MathEpisode(Episode):
    def __init__(self, grader: MathGrader, sample: Sample, config: MathEnvConfig) -> None:
        self.messages = math_messages(sample, config.system_prompt, config.instruction)
        self._grader = grader
        self._answer = str(sample["answer"])

    def step(self, action: str) -> StepResult:
        grade = self._grader.grade(action, self._answer)
        info = {"grade": grade.status, "answer": grade.answer, "grade_s": round(grade.elapsed_s, 3)}
        return StepResult(reward=grade.reward, done=True, info=info)


class MathEnvironment(Environment):
    name: ClassVar[str] = "math"
    Config: ClassVar[type[BaseModel]] = MathEnvConfig

    def __init__(self, config: MathEnvConfig | None = None) -> None:
        self.config = config or MathEnvConfig()
        self.grader = MathGrader(self.config.grader)

    def start(self, sample: Sample) -> MathEpisode:
        return MathEpisode(self.grader, sample, self.config)

    def close(self) -> None:
        self.grader.close()
