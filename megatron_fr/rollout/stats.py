"""What the rollout side reports once a step (RolloutService.stats), typed: the step's record
(orchestrator/step_record.py) reads named fields, and a renamed counter is a type error, not
a KeyError at the first step. It crosses the rollout process's proxy as it is (a frozen
dataclass)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RolloutStats:
    rollouts_total: int
    """Rollouts completed over the whole run (resumes included)."""
    rollout_failures_total: int
    rollout_failures: dict[str, int]
    """Rollouts that failed, by reason."""
    occupancy: int
    """Trajectories queued in the lag buffer now."""
    dropped_total: int
    """Trajectories dropped as older than max_lag."""
    stale_tokens_masked_total: int
    """Trajectories trained with their too-old tokens masked (buffer.mask_stale_tokens)."""
    discarded_total: int
    """Trajectories discarded with their group (a member failed or was invalid)."""
    abandoned_total: int
    """Rollouts given up on (failed)."""
    groups_failed_total: int
    engines: dict[str, float]
    """engines_total, the pool's figures (rollout/supervisor.py) and per engine of the pool,
    engine<i>_requests_total / _failures_total / _timeouts_total / _in_flight_limit: keyed by
    the engine's place in the pool, so a dict."""
    buffer: dict[str, Any] = field(default_factory=dict)
    """The rest of the lag buffer's figures (LagBuffer.stats: lag histogram, rejections...)."""
