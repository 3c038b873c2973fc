"""LagAwareBuffer: the bounded, lag-aware queue between rollout workers and the learner.

    rollout worker                 buffer                                 learner at version v
    try_admit / admit(_async) ───► in_flight (slot reserved)
      ... samples with weights >= v ...
    put(trajectory) ─────────────► valid and fresh? ─ yes ─► queue (FIFO) ─► next_batch(v),
                                          │ no                    │ too old   get_batch(_async)(v):
    abandon(prompt_id) ──────────► slot freed                     │ at v      B trajectories,
                                          ▼                       │           lag <= max_lag
    pop_requeued() ◄────────────── requeued prompts ◄─────────────┘

Two limits act on a rollout. Before it starts, admission keeps the rollouts in flight and the
queue small enough that all of them can be trained within max_lag versions (the staleness
budget, `_admission_open`) and within `capacity` (backpressure). When the learner asks for a
batch, every trajectory older than max_lag is dropped (`_is_fresh`): the budget bounds lag on
average, the drop bounds it for each trajectory. A dropped, rejected or abandoned rollout gives
its prompt back through `pop_requeued`, so no prompt is lost.

Worked example, B = 4, max_lag = 1, learner at version 5: the batches of versions 5 and 6 will
be trained before version 7, so 8 rollouts may be pending (in flight or queued). Once the
learner has taken its batch at version 5, 4 may be pending (they are for version 6's batch);
when it reports version 6, 8 again. A trajectory whose oldest token is from version 3 is
dropped at version 5 (lag 2 > 1).

A prompt_id names one rollout slot: it can be live (in flight or queued) once at a time, so
the B trajectories of a batch are B distinct prompts. Group estimators (G rollouts per
prompt) give each rollout its own id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

from megatron_fr.buffer.trajectory import InvalidTrajectory, Trajectory, validate_trajectory
from megatron_fr.config.buffer import BufferConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

PutOutcome = Literal["queued", "dropped", "rejected"]

STATE_FORMAT = 1
"""Version of the state_dict layout; load_state_dict refuses any other."""


class NotAdmittedError(LookupError):
    """put or abandon for a prompt_id that has no rollout in flight."""


@dataclass
class _Counters:
    """Totals since the run started (kept across checkpoints)."""

    admitted: int = 0
    consumed: int = 0
    dropped: int = 0
    rejected: int = 0
    abandoned: int = 0
    requeued: int = 0


class LagAwareBuffer:
    """Thread safe (one lock, one condition); the *_async methods never block the event loop
    for longer than a short critical section."""

    def __init__(self, config: BufferConfig, version: int = 0) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._version = version
        self._consumed_at_version = 0
        """Trajectories consumed in batches formed at self._version."""
        self._in_flight: dict[str, None] = {}
        """Ordered set of admitted prompt ids whose trajectory has not come back."""
        self._queue: deque[Trajectory] = deque()
        self._queued_ids: set[str] = set()
        self._requeued: deque[str] = deque()
        self._counts = _Counters()
        self._rejected_reasons: Counter[str] = Counter()
        self._lag_histogram: Counter[int] = Counter()
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # ---- admission (rollout side) ----------------------------------------------------------

    def try_admit(self, prompt_id: str) -> bool:
        """Reserve a slot for a rollout of prompt_id if the limits allow it now."""
        with self._cond:
            return self._try_admit(prompt_id)

    def admit(self, prompt_id: str, timeout: float | None = None) -> bool:
        """try_admit, waiting up to timeout seconds (None: forever); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._try_admit(prompt_id), timeout)

    async def admit_async(self, prompt_id: str, timeout: float | None = None) -> bool:
        """admit for asyncio code; cancelling it leaves nothing admitted."""
        return await self._wait_async(lambda: self._try_admit(prompt_id), timeout)

    def _try_admit(self, prompt_id: str) -> bool:
        if not isinstance(prompt_id, str) or not prompt_id:
            raise ValueError(f"prompt_id must be a non-empty string, got {prompt_id!r}")
        if prompt_id in self._in_flight or prompt_id in self._queued_ids:
            state = "in flight" if prompt_id in self._in_flight else "queued"
            raise ValueError(f"prompt_id {prompt_id!r} is already {state}; admit it once")
        if not self._admission_open():
            return False
        self._in_flight[prompt_id] = None
        self._counts.admitted += 1
        return True

    def _admission_open(self) -> bool:
        """Whether one more rollout may start now.

        Staleness budget (after AReaL's staleness manager). One optimizer step consumes one
        batch, so from version v the learner trains on the batches of versions v .. v+max_lag,
        (max_lag + 1) * B trajectories, before it reaches v + max_lag + 1; consumed_at_version
        of them were already taken at v. A rollout admitted now samples with weights >= v, so
        it is young enough for any of those batches. Admission keeps

            admitted_total - retired_total <= consumed_before_v + (max_lag + 1) * B

        with retired = dropped + rejected + abandoned (admitted, never to be trained) and
        consumed_before_v = consumed_total - consumed_at_version. Counted from version 0 with
        one batch per version, consumed_before_v = v * B: AReaL's
        admitted_total <= (v + max_lag + 1) * B + retired_total. Subtracting consumed_total
        from both sides gives the form enforced here (pending = in_flight + queued):

            pending + consumed_at_version <= (max_lag + 1) * B

        Every other call only lowers the left side (put keeps it or retires, a batch moves B
        from pending to consumed_at_version, a new version resets consumed_at_version), so the
        bound holds after every call. It bounds lag on average; a rollout overtaken by later
        ones can still miss its batches, and `_is_fresh` drops it then.
        """
        pending = len(self._in_flight) + len(self._queue)
        if pending >= self.config.capacity:
            return False
        max_in_flight = self.config.max_in_flight
        if max_in_flight is not None and len(self._in_flight) >= max_in_flight:
            return False
        budget = (self.config.max_lag + 1) * self.config.batch_size
        return pending + self._consumed_at_version < budget

    # ---- finished or failed rollouts -------------------------------------------------------

    def put(self, trajectory: Trajectory) -> PutOutcome:
        """Hand in the trajectory of an admitted rollout. An invalid one is rejected (counted
        by reason) and a too-old one dropped; both give their prompt back via pop_requeued."""
        try:
            validate_trajectory(trajectory)
            problem = None
        except InvalidTrajectory as error:
            problem = error
        prompt_id = trajectory.prompt_id
        with self._cond:
            self._release(prompt_id, "put")
            if problem is not None:
                logger.warning("rejected trajectory %r: %s", prompt_id, problem)
                self._counts.rejected += 1
                self._rejected_reasons[problem.reason] += 1
                outcome: PutOutcome = "rejected"
            elif not self._is_fresh(trajectory):
                self._counts.dropped += 1
                outcome = "dropped"
            else:
                self._queue.append(trajectory)
                self._queued_ids.add(prompt_id)
                outcome = "queued"
            if outcome != "queued":
                self._requeue(prompt_id)
            self._changed()
            return outcome

    def abandon(self, prompt_id: str) -> None:
        """A rollout that failed: free its slot and give its prompt back."""
        with self._cond:
            self._release(prompt_id, "abandon")
            self._counts.abandoned += 1
            self._requeue(prompt_id)
            self._changed()

    def pop_requeued(self) -> list[str]:
        """Prompts whose rollout was dropped, rejected or abandoned, oldest first (once each)."""
        with self._cond:
            prompts = list(self._requeued)
            self._requeued.clear()
            return prompts

    def _release(self, prompt_id: str, action: str) -> None:
        if prompt_id not in self._in_flight:
            raise NotAdmittedError(
                f"{action}: prompt_id {prompt_id!r} has no rollout in flight "
                "(never admitted, or already put/abandoned)"
            )
        del self._in_flight[prompt_id]

    def _requeue(self, prompt_id: str) -> None:
        self._requeued.append(prompt_id)
        self._counts.requeued += 1

    # ---- versions and batches (learner side) -----------------------------------------------

    def set_version(self, version: int) -> None:
        """The policy version rollouts now sample with (call it after each weight sync)."""
        with self._cond:
            self._advance(version)

    def next_batch(self, current_version: int) -> list[Trajectory] | None:
        """The B oldest-queued fresh trajectories for the learner at current_version, or None
        while fewer than B are queued. Advances the buffer's version to current_version."""
        with self._cond:
            return self._next_batch(current_version)

    def get_batch(
        self, current_version: int, timeout: float | None = None
    ) -> list[Trajectory] | None:
        """next_batch, waiting up to timeout seconds (None: forever); None on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._next_batch(current_version), timeout)

    async def get_batch_async(
        self, current_version: int, timeout: float | None = None
    ) -> list[Trajectory] | None:
        """get_batch for asyncio code."""
        return await self._wait_async(lambda: self._next_batch(current_version), timeout)

    def _next_batch(self, current_version: int) -> list[Trajectory] | None:
        self._advance(current_version)
        size = self.config.batch_size
        if len(self._queue) < size:
            return None
        # The queue holds only fresh trajectories (see _is_fresh), so FIFO order is kept.
        batch = [self._queue.popleft() for _ in range(size)]
        for trajectory in batch:
            self._queued_ids.remove(trajectory.prompt_id)
            self._lag_histogram[current_version - trajectory.oldest_version] += 1
        self._counts.consumed += size
        self._consumed_at_version += size
        self._changed()
        return batch

    def _advance(self, version: int) -> None:
        if version < self._version:
            raise ValueError(
                f"version {version} is older than the buffer's version {self._version}; "
                "policy versions only grow"
            )
        if version == self._version:
            return
        self._version = version
        self._consumed_at_version = 0
        self._drop_stale()
        self._changed()

    def _is_fresh(self, trajectory: Trajectory) -> bool:
        """INVARIANT (the lag bound): every queued trajectory has
        oldest_version >= version - max_lag. It is checked on put and re-established for the
        whole queue whenever the version grows; batches are taken from the queue at the
        current version, so no batch holds a trajectory with lag > max_lag."""
        return trajectory.oldest_version >= self._version - self.config.max_lag

    def _drop_stale(self) -> None:
        fresh: deque[Trajectory] = deque()
        for trajectory in self._queue:
            if self._is_fresh(trajectory):
                fresh.append(trajectory)
            else:
                self._queued_ids.remove(trajectory.prompt_id)
                self._counts.dropped += 1
                self._requeue(trajectory.prompt_id)
        self._queue = fresh

    # ---- waiting ----------------------------------------------------------------------------

    def _changed(self) -> None:
        """Wake every waiter (threads and coroutines) to re-check; called with the lock held."""
        self._cond.notify_all()
        for loop, event in self._async_waiters:
            # A waiter whose loop is already closed cannot be woken and no longer cares.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    async def _wait_async(self, attempt: Callable[[], T], timeout: float | None) -> T:
        """Retry `attempt` (run under the lock) at each change until it returns something truthy
        or the timeout passes. The waiter registers under the same lock as the failed attempt,
        so no change can slip between the two; the attempt itself never runs off the loop, so a
        cancelled wait has done nothing."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        waiter = (loop, asyncio.Event())
        while True:
            with self._cond:
                result = attempt()
                if result or (deadline is not None and loop.time() >= deadline):
                    return result
                waiter[1].clear()
                self._async_waiters.add(waiter)
            try:
                remaining = None if deadline is None else deadline - loop.time()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1].wait(), remaining)
            finally:
                with self._cond:
                    self._async_waiters.discard(waiter)

    # ---- observability and checkpoints ------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Occupancy and totals; lag = version at consumption - oldest_version (None before
        the first batch)."""
        with self._cond:
            lags = self._lag_histogram
            consumed = sum(lags.values())
            lag_mean = sum(lag * n for lag, n in lags.items()) / consumed if consumed else None
            return {
                "version": self._version,
                "occupancy": len(self._queue),
                "in_flight": len(self._in_flight),
                "requeued_pending": len(self._requeued),
                **{f"{name}_total": count for name, count in asdict(self._counts).items()},
                "rejected_reasons": dict(self._rejected_reasons),
                "lag_histogram": dict(sorted(lags.items())),
                "lag_mean": lag_mean,
                "lag_max": max(lags) if lags else None,
            }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot for checkpoint/resume."""
        with self._cond:
            return {
                "format": STATE_FORMAT,
                "version": self._version,
                "consumed_at_version": self._consumed_at_version,
                "queued": [trajectory.to_dict() for trajectory in self._queue],
                "in_flight": list(self._in_flight),
                "requeued": list(self._requeued),
                "counters": asdict(self._counts),
                "rejected_reasons": dict(self._rejected_reasons),
                "lag_histogram": sorted(self._lag_histogram.items()),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict() into a fresh buffer. The rollouts that were in flight are
        lost with the old process: their prompts come back as requeued (counted abandoned)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"buffer state format {state.get('format')!r} != {STATE_FORMAT}")
        queued = [validate_trajectory(Trajectory.from_dict(row)) for row in state["queued"]]
        queued_ids = {trajectory.prompt_id for trajectory in queued}
        if len(queued_ids) != len(queued):
            raise ValueError("buffer state queues the same prompt_id twice")
        if len(queued) > self.config.capacity:
            raise ValueError(
                f"buffer state holds {len(queued)} queued trajectories, more than capacity "
                f"{self.config.capacity}"
            )
        with self._cond:
            if self._counts.admitted or self._requeued:
                raise RuntimeError("load_state_dict needs a fresh buffer (nothing admitted yet)")
            self._version = state["version"]
            self._consumed_at_version = state["consumed_at_version"]
            self._queue = deque(queued)
            self._queued_ids = queued_ids
            self._requeued = deque(state["requeued"])
            self._counts = _Counters(**state["counters"])
            self._rejected_reasons = Counter(state["rejected_reasons"])
            self._lag_histogram = Counter({lag: n for lag, n in state["lag_histogram"]})
            for prompt_id in state["in_flight"]:
                self._counts.abandoned += 1
                self._requeue(prompt_id)
            # A smaller max_lag than the saved run's may leave queued trajectories too old.
            self._drop_stale()
            self._changed()
