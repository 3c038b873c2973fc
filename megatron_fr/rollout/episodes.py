"""Episode producers: one problem -> one trajectory row, through the inference engines.

The rollout service (rollout/service.py) knows problems only by id; a producer knows what a
problem is (a token-id prompt, a dataset row, an environment's game), how to play it through
the engines and how to score it. One producer per kind of task, behind one small interface:

    producer.train_problems / producer.eval_sets       the problem ids the service hands out
    await producer.run(client, problem, prompt_id, group, sampling)  -> Trajectory
    producer.close()

`run` raises EpisodeFailed for an episode that produced nothing trainable (counted by the
service like a failed generation); any other exception is a bug and ends the run.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.client import Rollout, RolloutClient
from megatron_fr.engine.protocol import SamplingParams
from megatron_fr.rollout.agent import policy_version


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

    async def run(
        self,
        client: RolloutClient,
        problem: str,
        prompt_id: str,
        group: str,
        sampling: SamplingParams,
    ) -> Trajectory: ...

    def close(self) -> None: ...


def single_turn_trajectory(
    prompt_id: str, rollout: Rollout, reward: float, info: dict
) -> Trajectory:
    """Prompt tokens (no policy) then the generated tokens with the engine's log-probs,
    per-token weight versions and, when the client asked for them, routed experts (a call
    from position 0 covers every position the learner feeds)."""
    prompt, output = list(rollout.prompt_ids), list(rollout.output_ids)
    return Trajectory(
        prompt_id=prompt_id,
        token_ids=prompt + output,
        action_mask=[False] * len(prompt) + [True] * len(output),
        behavior_log_probs=[0.0] * len(prompt) + list(rollout.output_logprobs),
        token_versions=[NON_POLICY_VERSION] * len(prompt)
        + [policy_version(v) for v in rollout.token_versions],
        reward=reward,
        info={**info, "finish_reason": rollout.finish_reason, "server": rollout.server},
        routed_experts=rollout.routed_experts,
    )


class TokenTaskEpisodes:
    """A task in token ids (tasks/arithmetic.py): prompt ids in, generated ids scored, one turn.

    The reward runs in a worker thread so that a slow scorer never stalls the event loop that
    drives every other generation."""

    def __init__(self, task, *, train_size: int, eval_size: int, seed: int) -> None:
        train = task.problems("train", train_size, seed=seed)
        evals = task.problems("eval", eval_size, seed=seed)
        self.task = task
        self._problems = {p.id: p for p in train + evals}
        self.train_problems = [p.id for p in train]
        self.eval_sets = {"eval": [p.id for p in evals]}
        self.pad_id = task.pad_id

    def sampling(self, temperature: float, top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=self.task.max_new_tokens,
            stop_token_ids=list(self.task.stop_token_ids),
        )

    async def run(
        self,
        client: RolloutClient,
        problem: str,
        prompt_id: str,
        group: str,
        sampling: SamplingParams,
    ) -> Trajectory:
        spec = self._problems[problem]
        rollout = await client.generate(spec.prompt_ids, sampling)
        reward = await asyncio.to_thread(self.task.reward, spec, list(rollout.output_ids))
        if not rollout.output_ids:
            raise EpisodeFailed("no tokens generated")
        return single_turn_trajectory(prompt_id, rollout, reward, {"group": group})

    def close(self) -> None:
        """Nothing held."""
