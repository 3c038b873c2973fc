"""Two-turn demonstrations of the Python tool, for the python_tool CPU twin's warm start.

A randomly initialised tiny model never writes a well-formed tool call, so its episodes would
be single-turn and always score 0, and the twin would test neither the multi-turn row nor
the environment's reward. Samples that carry a reference program (`code`, as the bundled
envs/data/python_tool.jsonl rows do) give a solver's two turns instead:

    turn 1   prompt (the python_tool environment's opening messages and tool schema)
             -> <tool_call>{"name": "python", "arguments": {"code": <code>}}</tool_call>
    turn 2   the same conversation + that call + the tool's answer (the reference answer,
             as the program prints it) -> "The answer is \\boxed{<answer>}."

both rendered by the model's chat template exactly as the agent loop renders them. A slip is
turn 2 with the boxed answer off by one. Implements the Task protocol the warm start trains.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_fr.demo.arithmetic import Problem
from megatron_fr.envs.base import Sample
from megatron_fr.envs.python_tool import TOOL_NAME, PythonToolConfig, PythonToolEnvironment

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class _Demo:
    prompt_ids: list[int]
    target: str
    slip: str


def tool_call_text(code: str) -> str:
    arguments = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}})
    return f"<tool_call>\n{arguments}\n</tool_call>"


def answer_text(answer: str) -> str:
    return f"The answer is \\boxed{{{answer}}}."


class ToolDemonstrations:
    """Every (sample, turn) of `samples` as a warm-start problem ("<id>#<turn>")."""

    name = "tool_demonstrations"

    def __init__(
        self, samples: list[Sample], config: PythonToolConfig, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        from megatron_fr.demo.tiny_models import chat_stop_token_ids
        from megatron_fr.rollout.chat import chat_format

        missing = [s["id"] for s in samples if not isinstance(s.get("code"), str)]
        if missing:
            raise ValueError(f"samples {missing} carry no reference program ('code')")
        self.config, self.tokenizer = config, tokenizer
        self.chat = chat_format(tokenizer, chat_stop_token_ids(tokenizer))
        self.stop_token_ids, self.pad_id = self.chat.stop_token_ids, tokenizer.pad_token_id
        self.environment = PythonToolEnvironment(config)
        self._demos = {key: demo for sample in samples for key, demo in self._render(sample)}

    def _render(self, sample: Sample) -> Iterator[tuple[str, _Demo]]:
        episode = self.environment.start(sample)
        messages, tools = list(episode.messages), episode.tools
        episode.close()
        call = tool_call_text(sample["code"])
        first = self.chat.prompt_ids(messages, tools)
        conversation = [
            *messages,
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(sample["answer"])},
        ]
        second = self.chat.prompt_ids(conversation, tools)
        slip = answer_text(_off_by_one(str(sample["answer"])))
        yield f"{sample['id']}#0", _Demo(first, call, call)
        yield f"{sample['id']}#1", _Demo(second, answer_text(str(sample["answer"])), slip)

    @property
    def max_new_tokens(self) -> int:
        return max(len(self._encode(d.target)) for d in self._demos.values()) + 3

    def problems(self, split: str, count: int, seed: int | None = None) -> list[Problem]:
        """`count` demonstrations drawn with replacement (train and eval are the same few)."""
        rng = random.Random(seed)
        keys = rng.choices(sorted(self._demos), k=count)
        return [Problem(key, self._demos[key].prompt_ids, self._demos[key].target) for key in keys]

    def target_ids(self, problem: Problem) -> list[int]:
        return [*self._encode(self._demos[problem.id].target), self.stop_token_ids[0]]

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]:
        return [*self._encode(self._demos[problem.id].slip), self.stop_token_ids[0]]

    def reward(self, problem: Problem, output_ids: list[int]) -> float:
        """1 when the turn is the demonstration's (the warm start's own score)."""
        return float(self.chat.turn_text(list(output_ids)) == self._demos[problem.id].target)

    def close(self) -> None:
        self.environment.close()

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _off_by_one(answer: str) -> str:
    return str(int(answer) + 1) if answer.lstrip("-").isdigit() else answer + "1"
