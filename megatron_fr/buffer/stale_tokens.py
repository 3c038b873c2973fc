"""buffer.stale_policy = mask_stale_tokens: a trajectory's too-old policy tokens made context.

A rollout that spans weight updates (an agent episode's later turns, a response continued
after a sync) carries several policy versions. Dropping it once its OLDEST token is past
max_lag drops the long episodes first: they are the ones in flight across many versions. Yet
the loss corrects each token by its own ratio pi / mu, so the tokens that are still within
max_lag are as usable as those of a younger trajectory. Here the older ones become context
tokens, as a prompt or a tool output is: kept in the row (the later tokens were sampled
after them), out of the action mask, so the learner takes no gradient from them and counts
none of them in its normalisations (a trajectory's token count, its sequence-level gate KL).

    versions   -1 -1  3  3  4  4 -1  6  6      oldest allowed 4 (learner at 12, max_lag 8)
    mask        .  .  1  1  1  1  .  1  1
    after       .  .  .  .  1  1  .  1  1      2 stale tokens masked, versions -1 there
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.top_logprobs import TopLogProbs

STALE_TOKENS_MASKED = "stale_tokens_masked"
"""The info key that records how many policy tokens were made context (present only on a
trajectory that lost some)."""


def newest_version(trajectory: Trajectory) -> int:
    """The version of the trajectory's newest policy token: with mask_stale_tokens it is kept
    while this one is within max_lag."""
    return int(trajectory.token_versions[trajectory.action_mask].max())


def mask_stale_tokens(trajectory: Trajectory, oldest_allowed: int) -> Trajectory:
    """`trajectory` with every policy token of a version below `oldest_allowed` made a context
    token (action mask off, version NON_POLICY_VERSION, behaviour log-prob 0, its top-K row
    removed), the count in info[STALE_TOKENS_MASKED] (added to any earlier count); the same
    object when none is that old. Raises ValueError when no policy token would be left: such
    a trajectory is dropped, not trained."""
    mask, versions = trajectory.action_mask, trajectory.token_versions
    stale = mask & (versions < oldest_allowed)
    count = int(stale.sum())
    if not count:
        return trajectory
    if count == int(mask.sum()):
        raise ValueError(
            f"trajectory {trajectory.prompt_id!r} has no policy token of version >= "
            f"{oldest_allowed}"
        )
    top = trajectory.top_logprobs
    if top is not None:
        keep_rows = ~stale[mask]  # the top-K record has one row per policy token, in order
        top = TopLogProbs(top.ids[keep_rows], top.log_probs[keep_rows])
    info = dict(trajectory.info)
    info[STALE_TOKENS_MASKED] = info.get(STALE_TOKENS_MASKED, 0) + count
    return dataclasses.replace(
        trajectory,
        action_mask=mask & ~stale,
        token_versions=np.where(stale, NON_POLICY_VERSION, versions).astype(versions.dtype),
        behavior_log_probs=np.where(stale, 0.0, trajectory.behavior_log_probs).astype(
            trajectory.behavior_log_probs.dtype
        ),
        info=info,
        top_logprobs=top,
    )
