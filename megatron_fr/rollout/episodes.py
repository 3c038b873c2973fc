"""Episode producers: one problem -> one trajectory row, through the inference engines.

The rollout service (rollout/service.py) knows problems only by id; a producer knows what a
problem is (a dataset row, an environment's game), how to play it through the engines and how
to score it, behind one small interface:

    producer.train_problems / producer.eval_sets       the problem ids the service hands out
    await producer.run(client, problem, prompt_id, group, sampling)  -> Trajectory
    producer.close()

`run` raises EpisodeFailed for an episode that produced nothing trainable (counted by the
service like a failed generation); any other exception is a bug and ends the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from dataclasses import dataclass
from typing import Protocol

from megatron_fr.buffer.trajectory import Trajectory, TrajectorySummary
from megatron_fr.config.tasks import AgentConfig
from megatron_fr.engine.client import RolloutClient
from megatron_fr.engine.types import SamplingParams
from megatron_fr.envs.base import Environment, Sample
from megatron_fr.rollout.agent import run_episode
from megatron_fr.rollout.chat import ChatFormat


class EpisodeFailed(RuntimeError):
    """An episode that ended without a trainable row; `reason` is short and countable."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        super().__init__(reason + (f": {detail}" if detail else ""))


class EpisodeProducer(Protocol):
    train_problems: list[str]
    eval_sets: dict[str, list[str]]
    """Named held-out sets of problem ids."""
    pad_id: int

    def sampling(self, temperature: float, top_p: float = 1.0) -> SamplingParams:
        """The task's sampling (its token budget and stop tokens) at this temperature."""

    async def run(
        self,
        client: RolloutClient,
        problem: str,
        prompt_id: str,
        group: str,
        sampling: SamplingParams,
    ) -> Trajectory: ...

    def close(self) -> None: ...


class AgentEpisodes:
    """A text task: each problem is a dataset sample, played through the agent loop against
    its environment with the model's own chat template (one turn for math, several for the
    agent tasks). The environment gives the reward; responses cut by a length limit are
    flagged and handled as the task says (TextTaskHandling)."""

    def __init__(
        self,
        *,
        chat: ChatFormat,
        environment: Environment,
        agent: AgentConfig,
        train: list[Sample],
        eval_sets: dict[str, list[Sample]],
        max_new_tokens: int,
        handling: TruncationHandling,
    ) -> None:
        self.chat, self.environment, self.agent = chat, environment, agent
        self.max_new_tokens, self.handling = max_new_tokens, handling
        self._samples = {sample["id"]: sample for sample in train}
        self.train_problems = list(self._samples)
        self.eval_sets = {}
        for name, samples in eval_sets.items():
            keys = [f"{name}/{sample['id']}" for sample in samples]
            self._samples.update(zip(keys, samples, strict=True))
            self.eval_sets[name] = keys
        tokenizer = chat.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def sampling(self, temperature: float, top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.chat.stop_token_ids,
        )

    async def run(
        self,
        client: RolloutClient,
        problem: str,
        prompt_id: str,
        group: str,
        sampling: SamplingParams,
    ) -> Trajectory:
        sample = self._samples[problem]
        # starting an episode may block (a game is generated or loaded): off the event loop
        episode = await asyncio.to_thread(self.environment.start, sample)
        try:
            result = await run_episode(
                client, self.chat, episode, sampling, self.agent, prompt_id, info={"group": group}
            )
        finally:
            await asyncio.to_thread(episode.close)
        if result.trajectory is None:
            raise EpisodeFailed(
                f"episode ended without a trainable row ({result.finish})", result.error or ""
            )
        truncated = result.finish == "max_episode_tokens" or (
            bool(result.turns) and result.turns[-1].finish_reason == "length"
        )
        return self.handling.apply(result.trajectory, truncated)

    def close(self) -> None:
        self.environment.close()


@dataclass(frozen=True)
class TruncationHandling:
    """What a response cut by a length limit becomes (the task's `truncated` setting)."""

    mode: str
    """reward: scored as it is; penalty: DAPO's soft overlong penalty; mask: out of the loss."""
    max_tokens: int
    """The policy-token budget the penalty counts against."""
    buffer_tokens: int = 0
    penalty: float = 1.0

    def apply(self, trajectory: Trajectory, truncated: bool) -> Trajectory:
        info = {**trajectory.info, "truncated": truncated}
        reward = trajectory.reward
        if self.mode == "penalty":
            reward -= self.overlong_penalty(trajectory.num_policy_tokens, truncated)
        if self.mode == "mask" and truncated:
            info["loss_masked"] = True  # the learner gives it advantage 0 (it stays in B)
        return dataclasses.replace(trajectory, reward=reward, info=info)

    def overlong_penalty(self, length: int, truncated: bool) -> float:
        """DAPO's soft overlong punishment: 0 up to max - buffer, then rising linearly to the
        full penalty at max; a truncated response always gets the full penalty."""
        if truncated:
            return self.penalty
        start = self.max_tokens - self.buffer_tokens
        if self.buffer_tokens == 0 or length <= start:
            return 0.0
        return self.penalty * min(1.0, (length - start) / self.buffer_tokens)


def episode_metrics(batch: list[TrajectorySummary]) -> dict[str, float]:
    """Per-batch figures of text tasks: turns, truncation, and tool use (python_tool): calls
    and failed calls per trajectory, the share of trajectories that call the tool at least
    once (a policy that stops using its tool shows here first), and the share of calls that
    ran ("ok"; logged only when the batch made a call)."""
    infos = [t.info for t in batch if "turns" in t.info]
    if not infos:
        return {}
    statuses = [
        [s for step in info.get("steps", []) for s in step.get("tool_statuses", [])]
        for info in infos
    ]
    calls = [status for per_trajectory in statuses for status in per_trajectory]
    figures = {
        "turns_mean": statistics.fmean(info["turns"] for info in infos),
        "truncated_rate": statistics.fmean(bool(info.get("truncated")) for info in infos),
        "tool_calls_mean": statistics.fmean(len(s) for s in statuses),
        "tool_errors_mean": statistics.fmean(sum(x != "ok" for x in s) for s in statuses),
        "tool_use_rate": statistics.fmean(bool(s) for s in statuses),
    }
    if calls:
        figures["tool_success_rate"] = statistics.fmean(status == "ok" for status in calls)
    return figures
