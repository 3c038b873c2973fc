"""What the learner's first rank asks of the rollout service, wherever the service runs.

RolloutService implements it; the rollout process (orchestrator/rollout_process.py) serves a
service through a proxy typed as this protocol and its run's additions (utils/process_proxy.py),
so a call keeps its types across the process boundary and the service's errors keep their
class (EngineDied on the first rank is EngineDied).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from megatron_fr.buffer.lag_buffer import LengthRecord
    from megatron_fr.rollout.stats import RolloutStats


class RolloutControl(Protocol):
    def start(self) -> None:
        """Start generating (after the engines serve the learner's weights)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Before start(): the buffer (prompt cursor included) and the counters as saved."""
        ...

    def state_dict(self) -> dict: ...

    def membership(self) -> tuple[int, list[str]]:
        """The pool's epoch and the engines the next weight sync must reach."""
        ...

    def joining(self) -> list[str]:
        """The engines waiting for a weight sync to serve (restarted, back, or new)."""
        ...

    def synced(self, urls: list[str], version: int) -> None:
        """A weight sync reached `urls` at `version`: the joining ones among them serve."""
        ...

    def take_out(self, urls: list[str], cause: str) -> None:
        """Engines the weight sync found not answering within its bound leave the pool."""
        ...

    def set_version(self, version: int) -> None:
        """The learner's weights are at `version` now (the buffer's staleness is counted from
        it)."""
        ...

    def stats(self) -> RolloutStats:
        """The buffer's, the rollouts' and the engines' figures for the step's metrics."""
        ...

    def take_lengths(self) -> LengthRecord:
        """The response lengths generated and dropped as stale since the previous call (once
        a step, for batches.jsonl)."""
        ...

    def explain(self, error: BaseException) -> None:
        """Raise the service's own failure instead of `error` when both come from one cause."""
        ...

    def close(self) -> None:
        """Stop generating and stop the engines the service started; idempotent."""
        ...
