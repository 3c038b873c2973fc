"""Trajectories built from engine rollouts for the tests that need real ones without the agent
loop: one generate call per trajectory."""

from __future__ import annotations

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.client import Rollout
from megatron_fr.rollout.agent import policy_version


def single_turn_trajectory(
    prompt_id: str, rollout: Rollout, reward: float, info: dict
) -> Trajectory:
    """A one-turn row: prompt tokens (no policy) then the generated tokens with the engine's
    log-probs, per-token weight versions and routed experts."""
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
