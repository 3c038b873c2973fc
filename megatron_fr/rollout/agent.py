"""The agent loop: one multi-turn episode against an environment -> one trajectory row.

    messages = episode.messages ─► ids = chat template (add_generation_prompt)   [mask 0]
    repeat (at most max_turns, within the token and time budgets):
        client.generate(ids) ─► output ids + log-probs + versions              [mask 1]
        text = decode(output, without the end-of-turn token)
        episode.step(text)    (in a worker thread: sandboxes and graders block)
        done? ─► stop
        observations ─► the template's text between this turn and the next
                        generation (end of turn if not generated, tool/user turn,
                        "<|im_start|>assistant\\n"), tokenised               [mask 0]

Invariant (what the learner relies on): action_mask is 1 exactly on the tokens the engine
returned, in the order and with the log-probs and versions it returned them; generated tokens
are never re-tokenised. Everything else (prompt, template scaffolding, observations) is 0.
Routed experts (when the client asks for them): each turn asks from the first position not
reported yet, so an observation is reported by the next turn, which feeds it as prompt; the
turns tile the row, every position with the routing the engine used when it first fed it.
Top-K log-probs (when the client asks for them) follow the policy tokens: one row per
generated token, the turns' rows in order.
The scaffolding comes from the tokenizer's own chat template: rendering the conversation with
a placeholder assistant turn and taking what follows the placeholder gives exactly the text
the template puts between an assistant turn's content and the next generation prompt, for
any template (Qwen2.5, Qwen3, the test template).

Limits: max_turns; max_new_tokens_per_turn and max_episode_tokens (the whole row); a
generation's wall time (max_turn_time_s) and the episode's (max_episode_time_s): a generation
cut by a time limit is dropped, the row ends at the last complete turn; an environment step
still running at the episode's deadline is abandoned (a thread cannot be stopped, so
environments bound their own steps). Rows end on a policy token (trailing non-policy tokens
carry no learning signal and are not kept).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from megatron_fr.buffer.trajectory import (
    NON_POLICY_VERSION,
    InvalidTrajectory,
    Trajectory,
    validate_trajectory,
)
from megatron_fr.config.tasks import AgentConfig
from megatron_fr.engine.client import Rollout, RolloutClient
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.engine.types import SamplingParams
from megatron_fr.envs.base import Episode, Message
from megatron_fr.rollout.chat import ChatFormat

Finish = Literal[
    "done", "max_turns", "max_episode_tokens", "prompt_too_long", "time_limit", "turn_time_limit"
]


@dataclass(frozen=True)
class Turn:
    """One generate call and what followed it."""

    start: int
    """Index in the row of the turn's first generated token."""
    output_ids: list[int]
    finish_reason: str
    text: str
    observation_ids: list[int] = field(default_factory=list)
    """Non-policy ids appended after the turn (empty for the last one)."""


@dataclass(frozen=True)
class EpisodeResult:
    trajectory: Trajectory | None
    """None when no turn completed (nothing to train on), or the row failed validation."""
    turns: list[Turn]
    reward: float
    finish: Finish
    messages: list[Message]
    """The conversation as text (assistant turns as decoded)."""
    error: str | None = None
    """Why `trajectory` is None."""


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[RoutedExperts] = field(default_factory=list)
    """Routed experts of positions 0 .. routed_positions - 1, one part per turn."""
    top_logprobs: list[TopLogProbs] = field(default_factory=list)
    """Top-K log-probs of the policy tokens, one part per turn."""

    @property
    def routed_positions(self) -> int:
        return sum(part.positions for part in self.routing)

    def add_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NON_POLICY_VERSION] * len(ids)

    def add_policy(self, rollout: Rollout) -> None:
        self.ids += rollout.output_ids
        self.mask += [True] * len(rollout.output_ids)
        self.logprobs += rollout.output_logprobs
        self.versions += [policy_version(v) for v in rollout.token_versions]
        if rollout.routed_experts is not None:
            self.routing.append(rollout.routed_experts)
        if rollout.top_logprobs is not None:
            self.top_logprobs.append(rollout.top_logprobs)

    def trimmed(self) -> _Row:
        """The row up to its last policy token (every policy token and its top-K stay)."""
        end = max((i + 1 for i, m in enumerate(self.mask) if m), default=0)
        routing = [RoutedExperts.concatenate(self.routing).head(end - 1)] if self.routing else []
        return _Row(
            self.ids[:end],
            self.mask[:end],
            self.logprobs[:end],
            self.versions[:end],
            routing,
            self.top_logprobs,
        )


def policy_version(text: str) -> int:
    """Engine versions are strings; the learner's are the integers the weight sync sets. A
    non-integer ("default": never synced) maps to NON_POLICY_VERSION, which validation then
    refuses on a policy token."""
    return int(text) if text.lstrip("-").isdigit() else NON_POLICY_VERSION


def _clip(messages: list[Message], limit: int) -> list[Message]:
    return [
        {**m, "content": m["content"][:limit] + ("…" if len(m["content"]) > limit else "")}
        for m in messages
    ]


async def run_episode(
    client: RolloutClient,
    chat: ChatFormat,
    episode: Episode,
    sampling: SamplingParams,
    config: AgentConfig,
    prompt_id: str,
    info: dict[str, Any] | None = None,
) -> EpisodeResult:
    """Play `episode` to its end or a limit. The trajectory's info is `info` plus the
    episode's facts (turns, finish, each step's env info). A turn generates at most
    min(sampling.max_new_tokens, max_new_tokens_per_turn, what the row has left); the chat's
    end-of-turn ids join the stop tokens."""
    loop = _Loop(client, chat, episode, sampling, config, prompt_id)
    try:
        finish = await loop.play()
    finally:
        client.end_session(loop.session)
    facts = {"turns": len(loop.turns), "finish": finish, "steps": loop.steps}
    return loop.result(finish, {**(info or {}), **facts})


class _Loop:
    """The state of one run_episode call."""

    def __init__(
        self,
        client: RolloutClient,
        chat: ChatFormat,
        episode: Episode,
        sampling: SamplingParams,
        config: AgentConfig,
        prompt_id: str,
    ) -> None:
        self.client, self.chat, self.episode, self.config = client, chat, episode, config
        self.prompt_id = prompt_id
        self.stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *chat.stop_token_ids)))
        self.sampling = sampling
        self.session = f"{prompt_id}/{uuid.uuid4().hex[:8]}"
        self.deadline = time.monotonic() + config.max_episode_time_s
        self.messages = list(episode.messages)
        self.row = _Row()
        self.turns: list[Turn] = []
        self.steps: list[dict[str, Any]] = []
        self.reward = 0.0

    async def play(self) -> Finish:
        self.row.add_context(self.chat.prompt_ids(self.messages, self.episode.tools))
        if len(self.row.ids) >= self.config.max_episode_tokens:
            return "prompt_too_long"
        for number in range(self.config.max_turns):
            start = len(self.row.ids)
            rollout = await self._generate(number)
            if isinstance(rollout, str):
                return rollout
            text = self.chat.turn_text(rollout.output_ids)
            try:  # a step that never returns (a wedged game) must not wedge the worker
                result = await asyncio.wait_for(
                    asyncio.to_thread(self.episode.step, text),
                    timeout=max(self.deadline - time.monotonic(), 0.0),
                )
            except TimeoutError:
                return "time_limit"
            self.reward += result.reward
            self.steps.append(result.info)
            if result.done or number + 1 == self.config.max_turns:
                self.messages.append({"role": "assistant", "content": text})
                observations = []
            else:
                observations = self._observe(rollout, text, result.messages)
            turn = Turn(start, rollout.output_ids, rollout.finish_reason, text, observations)
            self.turns.append(turn)
            if result.done:
                return "done"
            if len(self.row.ids) + len(observations) >= self.config.max_episode_tokens:
                return "max_episode_tokens"
            self.row.add_context(observations)
        return "max_turns"

    async def _generate(self, number: int) -> Rollout | Finish:
        """One turn's generation appended to the row, or the limit that prevents it."""
        budget = min(
            self.sampling.max_new_tokens,
            self.config.max_new_tokens_per_turn,
            self.config.max_episode_tokens - len(self.row.ids),
        )
        remaining = self.deadline - time.monotonic()
        if budget <= 0:
            return "max_episode_tokens"
        if remaining <= 0:
            return "time_limit"
        request = self.sampling.model_copy(
            update={
                "max_new_tokens": budget,
                "stop_token_ids": self.stops,
                "sampling_seed": self._request_seed(number),
            }
        )
        generation = self.client.generate(
            self.row.ids,
            request,
            session_id=self.session,
            rid=f"{self.session}.{number}",
            routed_experts_from=self.row.routed_positions,
        )
        limit = min(self.config.max_turn_time_s, remaining)
        try:
            rollout = await asyncio.wait_for(generation, timeout=limit)
        except TimeoutError:
            return "turn_time_limit" if limit == self.config.max_turn_time_s else "time_limit"
        self.row.add_policy(rollout)
        return rollout

    def _request_seed(self, turn: int) -> int | None:
        """A seeded run's seed for this turn: a function of the run's seed, the prompt id and
        the turn, so a rerun samples the same tokens whatever order requests finish in."""
        if self.sampling.sampling_seed is None:
            return None
        key = f"{self.sampling.sampling_seed}/{self.prompt_id}/{turn}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=7).digest(), "big")

    def _observe(self, rollout: Rollout, text: str, observations: list[Message]) -> list[int]:
        """Ids between this turn and the next generation; the conversation grows by both."""
        new = _clip(observations, self.config.max_observation_chars)
        last = rollout.output_ids[-1] if rollout.output_ids else None
        ids = self.chat.between_turns_ids(self.messages, new, self.episode.tools, last)
        self.messages += [{"role": "assistant", "content": text}, *new]
        return ids

    def result(self, finish: Finish, info: dict[str, Any]) -> EpisodeResult:
        kept = self.row.trimmed()
        trajectory, error = None, None
        if not any(kept.mask):
            error = f"no policy token ({finish})"
        else:
            try:
                trajectory = validate_trajectory(
                    Trajectory(
                        prompt_id=self.prompt_id,
                        token_ids=np.asarray(kept.ids),
                        action_mask=np.asarray(kept.mask),
                        behavior_log_probs=np.asarray(kept.logprobs),
                        token_versions=np.asarray(kept.versions),
                        reward=self.reward,
                        info=info,
                        routed_experts=kept.routing[0] if kept.routing else None,
                        top_logprobs=TopLogProbs.concatenate(kept.top_logprobs)
                        if kept.top_logprobs
                        else None,
                    )
                )
            except InvalidTrajectory as invalid:
                error = str(invalid)
        return EpisodeResult(trajectory, self.turns, self.reward, finish, self.messages, error)
