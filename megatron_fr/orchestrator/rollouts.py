"""Rollout workers: turn problems into trajectories in the buffer, on their own event loop.

    PromptSource ─► admit (waits on the buffer's staleness budget) ─► RolloutClient.generate
        ─► reward ─► Trajectory (per-token versions from the engine) ─► buffer.put

Runs in a background thread of the first learner rank, so generation goes on while the
learner trains (asynchronous RL); the learner only waits when the buffer has no fresh batch.
Each rollout has its own prompt_id ("<problem>@<group>#<k>"); info["group"] ties the G
rollouts of one problem together for group baselines, and prompts the buffer hands back
(dropped as too old, rejected, abandoned) return to the PromptSource as problems.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import threading
from collections.abc import Callable

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.client import Rollout, RolloutClient, RolloutClientConfig
from megatron_fr.engine.protocol import SamplingParams
from megatron_fr.orchestrator.prompts import PromptSource

log = logging.getLogger("megatron_fr.rollouts")


def problem_of(prompt_id: str) -> str:
    return prompt_id.split("@", 1)[0]


def to_trajectory(prompt_id: str, group: str, rollout: Rollout, reward: float) -> Trajectory:
    prompt, output = list(rollout.prompt_ids), list(rollout.output_ids)
    return Trajectory(
        prompt_id=prompt_id,
        token_ids=prompt + output,
        action_mask=[False] * len(prompt) + [True] * len(output),
        behavior_log_probs=[0.0] * len(prompt) + list(rollout.output_logprobs),
        token_versions=[-1] * len(prompt) + [_version(v) for v in rollout.token_versions],
        reward=reward,
        info={"group": group, "finish_reason": rollout.finish_reason, "server": rollout.server},
    )


def _version(text: str) -> int:
    """Engine weight versions are strings; ours are the integers the sync sets (-1 otherwise,
    which validation then refuses as a policy token of no known version)."""
    return int(text) if text.lstrip("-").isdigit() else -1


class RolloutWorkers:
    def __init__(
        self,
        client_config: RolloutClientConfig,
        buffer: LagAwareBuffer,
        source: PromptSource,
        prompts: dict[str, list[int]],
        reward: Callable[[str, list[int]], float],
        sampling: SamplingParams,
        group_size: int,
    ):
        self.client_config, self.buffer, self.source = client_config, buffer, source
        self.prompts, self.reward = prompts, reward
        self.sampling, self.group_size = sampling, group_size
        self.completed = 0
        self._groups = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
        self._stopping = False
        self._client: RolloutClient | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._error: BaseException | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: None)
            self._thread.join(timeout=60)

    def check(self) -> None:
        """Re-raise, in the caller's thread, an error that stopped the workers."""
        if self._error is not None:
            raise RuntimeError(f"rollout workers stopped: {self._error}") from self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as error:  # surfaced to the training loop by check()
            self._error = error
            self._ready.set()

    async def _main(self) -> None:
        async with RolloutClient(self.client_config) as client:
            self._client = client
            self._ready.set()
            tasks: set[asyncio.Task] = set()
            while not self._stopping:
                admitted = await self._hand_out()
                if admitted is None:
                    break
                task = asyncio.create_task(self._group(*admitted))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- handing out problems -----------------------------------------------------------

    async def _hand_out(self) -> tuple[str, str, list[str]] | None:
        """The next problem with all its rollouts admitted, or None when stopping.

        The prompt cursor and the buffer change together under one lock, so a snapshot never
        sees a problem taken from the source but not yet admitted (it would be lost on
        resume) nor one admitted and still pending (it would be handed out twice)."""
        with self._lock:
            self.source.requeue(sorted({problem_of(p) for p in self.buffer.pop_requeued()}))
            problem = self.source.next()
            self._pending = problem
        group = f"{problem}@{next(self._groups)}"
        ids = [f"{group}#{k}" for k in range(self.group_size)]
        waiting = list(ids)
        while waiting:
            if self._stopping:
                with self._lock:
                    for prompt_id in ids[: len(ids) - len(waiting)]:
                        self.buffer.abandon(prompt_id)
                    self.buffer.pop_requeued()
                    self.source.requeue([problem])
                    self._pending = None
                return None
            with self._lock:
                if self.buffer.try_admit(waiting[0]):
                    waiting.pop(0)
                    if not waiting:
                        self._pending = None
                    continue
            await asyncio.sleep(0.02)
        return problem, group, ids

    def snapshot(self) -> tuple[dict, dict]:
        """(buffer state, prompt-source state) taken together, for a checkpoint; a problem
        being handed out right now is saved as re-queued."""
        with self._lock:
            prompts = self.source.state_dict()
            if self._pending is not None:
                prompts["requeued"] = [self._pending, *prompts["requeued"]]
            return self.buffer.state_dict(), prompts

    # --- one group of rollouts ----------------------------------------------------------

    async def _group(self, problem: str, group: str, prompt_ids: list[str]) -> None:
        results = await asyncio.gather(
            *(self._client.generate(self.prompts[problem], self.sampling) for _ in prompt_ids),
            return_exceptions=True,
        )
        for prompt_id, result in zip(prompt_ids, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("rollout %s failed: %s", prompt_id, result)
                self.buffer.abandon(prompt_id)
                continue
            reward = self.reward(problem, list(result.output_ids))
            self.buffer.put(to_trajectory(prompt_id, group, result, reward))
            self.completed += 1

    # --- evaluation ---------------------------------------------------------------------

    def evaluate(self, problems: dict[str, list[int]], repeats: int) -> tuple[float, float]:
        """(mean, std over passes) of the reward on held-out problems, sampled as in training."""
        future = asyncio.run_coroutine_threadsafe(self._evaluate(problems, repeats), self._loop)
        scores = future.result()
        return statistics.fmean(scores), statistics.pstdev(scores)

    async def _evaluate(self, problems: dict[str, list[int]], repeats: int) -> list[float]:
        scores = []
        for _ in range(repeats):
            rollouts = await asyncio.gather(
                *(self._client.generate(ids, self.sampling) for ids in problems.values())
            )
            rewards = [
                self.reward(problem, list(r.output_ids))
                for problem, r in zip(problems, rollouts, strict=True)
            ]
            scores.append(statistics.fmean(rewards))
        return scores
