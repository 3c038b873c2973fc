"""Sizes of the lag-aware buffer between rollouts and the learner (buffer/lag_buffer.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from megatron_fr.config.base import StrictModel

MAX_LAG = 1000
"""Most policy versions a trajectory may lag: the staleness budget (max_lag + 1) * batch_size
is held in memory, and more lag than this is no longer on-policy learning of any use."""


class BufferConfig(StrictModel):
    """Sizes of the buffer. The staleness budget (max_lag + 1) * batch_size already bounds what
    is pending; capacity is the memory bound on top of it."""

    capacity: PositiveInt
    """Most trajectories queued + in flight at once; admission waits (backpressure) at it."""
    batch_size: PositiveInt
    """B: trajectories per learner batch (one optimizer step)."""
    group_size: PositiveInt = 1
    """G: rollouts per problem, kept together as one group: 1 for FlashREINFORCE; G for the
    group baselines (GRPO, RLOO...). A batch holds B / G whole groups; a group with a failed,
    rejected or too-old member is discarded whole and its problem handed out again."""
    max_lag: int = Field(default=0, ge=0, le=MAX_LAG)
    """Most versions between a trajectory's oldest policy token and the learner that trains on
    it (at most 1000); 0 is synchronous on-policy training."""
    stale_policy: Literal["drop_trajectory", "mask_stale_tokens"] = "drop_trajectory"
    """What becomes of a trajectory whose tokens span policy versions once its OLDEST policy
    token is more than max_lag versions behind the learner. drop_trajectory: the whole group is
    dropped (a trajectory is as old as its oldest token). mask_stale_tokens: it is kept while
    its NEWEST policy token is within max_lag, and the policy tokens older than that are made
    context when its batch is taken (out of the loss, no gradient); a group is dropped only
    once a member has no policy token left within max_lag. Either way no token trained lags
    more than max_lag; the second keeps the long (multi-turn) episodes, which the first drops
    most often. The default is the measured choice: docs/results.md, "The stale drop and
    response length at lag 8"."""
    max_in_flight: PositiveInt | None = None
    """Most rollouts generating at once (e.g. what the servers can hold); None: no extra bound."""
    fill_staleness_budget: bool = False
    """The learner takes a batch only once the whole staleness budget, (max_lag + 1) * B
    trajectories, is queued, so after the first max_lag steps every trajectory is exactly
    max_lag versions old. That is the steady state of a rollout fleet faster than the learner
    (its queue is always full); this flag reproduces it where generation is the bottleneck,
    as on a CPU machine, to measure training at a given lag (`megatron-fr compare lag`). In
    production it only adds waiting: leave it off."""

    @property
    def staleness_budget(self) -> int:
        """(max_lag + 1) * B: the trajectories the learner trains on from one version before it
        is max_lag + 1 versions newer; admission keeps pending + consumed within it."""
        return (self.max_lag + 1) * self.batch_size

    @model_validator(mode="after")
    def _sizes_fit_together(self) -> BufferConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size {self.batch_size} must be a multiple of group_size "
                f"{self.group_size} (a batch holds whole groups)"
            )
        if self.max_in_flight is not None and self.max_in_flight < self.group_size:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be >= group_size "
                f"({self.group_size}): a group is admitted whole"
            )
        if self.capacity < self.batch_size:
            raise ValueError(
                f"capacity ({self.capacity}) must be >= batch_size ({self.batch_size}), "
                "or no batch can ever form"
            )
        if self.fill_staleness_budget and self.capacity < self.staleness_budget:
            raise ValueError(
                f"fill_staleness_budget needs capacity >= (max_lag + 1) * batch_size = "
                f"{self.staleness_budget} (it is {self.capacity}), or no batch can ever form"
            )
        return self
