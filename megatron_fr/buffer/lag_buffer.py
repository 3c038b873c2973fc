"""LagAwareBuffer: the one owner of rollout state between the prompt source and the learner.

    rollout worker                       buffer (one lock)                     learner at version v
    admit(_async) ─────────────────────► next problem (re-queued ones first) and G rollout
      Admission(problem, group, G ids)    slots reserved together (in flight)
      ... the G rollouts sample with weights >= v ...
    put(trajectory) ───────────────────► invalid? ──────────► group discarded whole ┐
    abandon(prompt_id)  (rollout failed) ───────────────────► group discarded whole ┤ problem
                                         all G in: fresh? ─ no ─► dropped whole ────┤ handed
                                              │ yes                                 │ out again
                                              ▼                                     │
                                         queue of whole groups ─► next_batch(v): B / G groups,
    set_version(v) ────────────────────► queued groups too old dropped whole ──────┘ lag <= max_lag
                                                                  (mask_stale_tokens: tokens
                                                                  older made context first)
    close(error) ──────────────────────► every waiter wakes: admit -> None, get_batch raises

The prompt cursor (PromptSource) lives here, under the same lock as the slots, so a
checkpoint (state_dict) never sees a problem taken from the cursor but not yet admitted, nor
one admitted twice; resuming re-issues exactly the problems whose groups never reached a batch.

Two limits act on a rollout. Before it starts, admission keeps the rollouts in flight and the
trajectories held small enough that all of them can be trained within max_lag versions (the
staleness budget, `_admission_open`) and within `capacity` (backpressure). When a group
completes, and whenever the version grows, every group older than max_lag is dropped
(`_is_fresh`): the budget bounds lag on average, the drop bounds it for each trajectory. How
old a group is depends on `stale_policy`. drop_trajectory (the default): as old as its oldest
policy token, over all members. mask_stale_tokens: a trajectory is as old as its NEWEST policy
token, a group as its oldest member by that measure; when a batch is taken its policy tokens
older than max_lag are made context (buffer/stale_tokens.py), so no token trained lags more
than max_lag either way. With `fill_staleness_budget` the learner also waits until the whole
budget is queued, which makes every trajectory exactly max_lag versions old (a fleet faster
than the learner, reproduced).

Groups are atomic (what group baselines need: GRPO's mean and std over a group of part of its
rollouts is a different estimator): a batch holds B / G whole groups, never part of one. With
G = 1 (FlashREINFORCE) a group is one rollout.

Worked example, B = 4, G = 1, max_lag = 1, learner at version 5: the batches of versions 5
and 6 will be trained before version 7, so 8 rollouts may be pending (in flight or held).
Once the learner has taken its batch at version 5, 4 may be pending (they are for version 6's
batch); when it reports version 6, 8 again. A trajectory whose oldest token is from version 3
is dropped at version 5 (lag 2 > 1); with mask_stale_tokens, one whose tokens are of
versions 3 and 4 is kept and trained on its version-4 tokens alone, one of version 3 only is
dropped.

Accounting (checked by the tests after every call): every admitted rollout is exactly one of
in flight, held (its group forming or queued), consumed, dropped (stale), rejected (invalid),
abandoned (failed), or discarded (a member of its group failed or was rejected).

Length record (`take_lengths`): the response lengths (policy tokens) of the trajectories handed
in valid and of those dropped as stale since the previous call, for the run's report: whether
the stale drop falls on the long episodes is read from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.buffer.stale_tokens import mask_stale_tokens, newest_version
from megatron_fr.buffer.trajectory import InvalidTrajectory, Trajectory, validate_trajectory
from megatron_fr.config.buffer import BufferConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

PutOutcome = Literal["held", "queued", "dropped", "rejected", "discarded"]

STATE_FORMAT = 2
"""Version of the state_dict layout; load_state_dict refuses any other."""


class NotAdmittedError(LookupError):
    """put or abandon for a prompt_id that has no rollout in flight."""


class BufferClosed(RuntimeError):
    """The buffer was closed (the run is ending); raised to the learner waiting for a batch,
    chained to the error that ended the run, if any."""


@dataclass(frozen=True)
class Admission:
    """One problem handed out with its G rollout slots reserved."""

    problem: str
    group: str
    """Unique per admission ("<problem>@<n>"): the G rollouts share it (group baselines)."""
    prompt_ids: tuple[str, ...]
    """One per rollout slot ("<group>#<k>"); put / abandon name the slot by it."""


@dataclass
class _Counters:
    """Totals since the run started (kept across checkpoints). Rollouts, except `requeued`
    and `groups_*`, which count problems / groups."""

    admitted: int = 0
    consumed: int = 0
    dropped: int = 0
    rejected: int = 0
    abandoned: int = 0
    discarded: int = 0
    requeued: int = 0
    groups_dropped: int = 0
    groups_failed: int = 0
    stale_tokens_masked: int = 0
    """Policy tokens made context in batches (stale_policy mask_stale_tokens); tokens, not
    rollouts."""


@dataclass
class LengthRecord:
    """Response lengths (policy tokens as generated) since the previous take_lengths."""

    generated: list[int] = field(default_factory=list)
    """Of every trajectory handed in valid (put), whatever became of it then."""
    dropped_stale: list[int] = field(default_factory=list)
    """Of every trajectory dropped as too old."""


@dataclass
class _Group:
    admission: Admission
    in_flight: set[str]
    done: dict[str, Trajectory] = field(default_factory=dict)
    failed: bool = False
    """A member failed or was rejected: the group will never be trained; members still in
    flight are discarded as they come back."""


class LagAwareBuffer:
    """Thread safe (one lock, one condition); the *_async methods never block the event loop
    for longer than a short critical section."""

    def __init__(self, config: BufferConfig, source: PromptSource, version: int = 0) -> None:
        self.config = config
        self._source = source
        self._cond = threading.Condition()
        self._version = version
        self._consumed_at_version = 0
        """Trajectories consumed in batches formed at self._version."""
        self._groups: dict[str, _Group] = {}
        """Admitted groups not yet queued (forming, or failed with members in flight)."""
        self._slot_group: dict[str, str] = {}
        """prompt_id of each rollout in flight -> its group."""
        self._held = 0
        """Trajectories of forming (not failed) groups."""
        self._queue: deque[list[Trajectory]] = deque()
        self._group_numbers = itertools.count()
        self._counts = _Counters()
        self._rejected_reasons: Counter[str] = Counter()
        self._lag_histogram: Counter[int] = Counter()
        self._lengths = LengthRecord()
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False
        self._close_error: BaseException | None = None

    # ---- admission (rollout side) ----------------------------------------------------------

    def try_admit(self) -> Admission | None:
        """The next problem with its G slots reserved, if the limits allow it now (None also
        once closed)."""
        with self._cond:
            return self._try_admit()

    def admit(self, timeout: float | None = None) -> Admission | None:
        """try_admit, waiting up to timeout seconds (None: forever); None on timeout or close."""
        with self._cond:
            result = self._cond.wait_for(lambda: self._try_admit() or self._closed, timeout)
            return result if isinstance(result, Admission) else None

    async def admit_async(self, timeout: float | None = None) -> Admission | None:
        """admit for asyncio code; cancelling it leaves nothing admitted."""
        result = await self._wait_async(lambda: self._try_admit() or self._closed, timeout)
        return result if isinstance(result, Admission) else None

    def _try_admit(self) -> Admission | None:
        if self._closed or not self._admission_open():
            return None
        problem = self._source.next()
        group = f"{problem}@{next(self._group_numbers)}"
        admission = Admission(
            problem, group, tuple(f"{group}#{k}" for k in range(self.config.group_size))
        )
        self._groups[group] = _Group(admission, set(admission.prompt_ids))
        for prompt_id in admission.prompt_ids:
            self._slot_group[prompt_id] = group
        self._counts.admitted += self.config.group_size
        return admission

    def _pending(self) -> int:
        """Rollouts that may still reach a batch: in flight, held in forming groups, queued."""
        live_in_flight = sum(len(g.in_flight) for g in self._groups.values() if not g.failed)
        return live_in_flight + self._held + len(self._queue) * self.config.group_size

    def _admission_open(self) -> bool:
        """Whether one more group of G rollouts may start now.

        Staleness budget (after AReaL's staleness manager). One optimizer step consumes one
        batch, so from version v the learner trains on the batches of versions v .. v+max_lag,
        (max_lag + 1) * B trajectories, before it reaches v + max_lag + 1; consumed_at_version
        of them were already taken at v. A rollout admitted now samples with weights >= v, so
        it is young enough for any of those batches. Admission keeps

            pending + consumed_at_version <= (max_lag + 1) * B

        (pending = rollouts that may still reach a batch: in flight or held). Every other
        call only lowers the left side (a completed group keeps it or retires G, a batch moves
        B from pending to consumed_at_version, a new version resets consumed_at_version), so
        the bound holds after every call. It bounds lag on average; a group overtaken by later
        ones can still miss its batches, and `_is_fresh` drops it then. A failed group's
        members still in flight hold slots of the `capacity` and `max_in_flight` limits (the
        engines are still working on them) but no longer of the staleness budget.
        """
        size = self.config.group_size
        pending = self._pending()
        in_flight = len(self._slot_group)
        if in_flight + self._held + len(self._queue) * size + size > self.config.capacity:
            return False
        max_in_flight = self.config.max_in_flight
        if max_in_flight is not None and in_flight + size > max_in_flight:
            return False
        return pending + self._consumed_at_version + size <= self.config.staleness_budget

    # ---- finished or failed rollouts -------------------------------------------------------

    def put(self, trajectory: Trajectory) -> PutOutcome:
        """Hand in the trajectory of an admitted rollout. "held" while its group is forming;
        when the group completes, "queued" or "dropped" (too old); "rejected" if invalid (its
        group is then discarded); "discarded" if its group had already failed."""
        try:
            validate_trajectory(trajectory)
            problem = None
        except InvalidTrajectory as error:
            problem = error
        with self._cond:
            group = self._release(trajectory.prompt_id, "put")
            if group.failed:
                self._counts.discarded += 1
                outcome: PutOutcome = "discarded"
            elif problem is not None:
                logger.warning("rejected trajectory %r: %s", trajectory.prompt_id, problem)
                self._counts.rejected += 1
                self._rejected_reasons[problem.reason] += 1
                self._fail(group)
                outcome = "rejected"
            else:
                self._lengths.generated.append(trajectory.num_policy_tokens)
                group.done[trajectory.prompt_id] = trajectory
                self._held += 1
                outcome = self._complete(group) if not group.in_flight else "held"
            self._forget_if_finished(group)
            self._changed()
            return outcome

    def abandon(self, prompt_id: str) -> None:
        """A rollout that failed: its slot is freed and its group discarded whole (the
        problem is handed out again)."""
        with self._cond:
            group = self._release(prompt_id, "abandon")
            self._counts.abandoned += 1
            if not group.failed:
                self._fail(group)
            self._forget_if_finished(group)
            self._changed()

    def _release(self, prompt_id: str, action: str) -> _Group:
        group_name = self._slot_group.pop(prompt_id, None)
        if group_name is None:
            raise NotAdmittedError(
                f"{action}: prompt_id {prompt_id!r} has no rollout in flight "
                "(never admitted, or already put/abandoned)"
            )
        group = self._groups[group_name]
        group.in_flight.discard(prompt_id)
        return group

    def _fail(self, group: _Group) -> None:
        group.failed = True
        self._counts.groups_failed += 1
        self._counts.discarded += len(group.done)
        self._held -= len(group.done)
        group.done.clear()
        self._requeue(group.admission.problem)

    def _complete(self, group: _Group) -> PutOutcome:
        members = [group.done[p] for p in group.admission.prompt_ids]
        self._held -= len(members)
        group.done.clear()
        if not self._is_fresh(members):
            self._drop(members)
            return "dropped"
        self._queue.append(members)
        return "queued"

    def _forget_if_finished(self, group: _Group) -> None:
        if not group.in_flight and not group.done:
            del self._groups[group.admission.group]

    def _drop(self, members: list[Trajectory]) -> None:
        self._lengths.dropped_stale.extend(t.num_policy_tokens for t in members)
        self._counts.dropped += len(members)
        self._counts.groups_dropped += 1
        self._requeue(_problem_of(members[0].prompt_id))

    def _requeue(self, problem: str) -> None:
        self._source.requeue([problem])
        self._counts.requeued += 1

    # ---- versions and batches (learner side) -----------------------------------------------

    def set_version(self, version: int) -> None:
        """The policy version rollouts now sample with (call it after each weight sync)."""
        with self._cond:
            self._advance(version)

    def next_batch(self, current_version: int) -> list[Trajectory] | None:
        """B / G whole groups, the oldest-completed first (the oldest-admitted first with
        fill_staleness_budget), for the learner at current_version, or None while fewer are
        queued (with mask_stale_tokens, their policy tokens older than max_lag made context).
        Advances the buffer's version to current_version."""
        with self._cond:
            return self._next_batch(current_version)

    def get_batch(
        self, current_version: int, timeout: float | None = None
    ) -> list[Trajectory] | None:
        """next_batch, waiting up to timeout seconds (None: forever); None on timeout.
        Raises BufferClosed once the buffer is closed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._next_batch(current_version), timeout)

    async def get_batch_async(
        self, current_version: int, timeout: float | None = None
    ) -> list[Trajectory] | None:
        """get_batch for asyncio code."""
        return await self._wait_async(lambda: self._next_batch(current_version), timeout)

    def _next_batch(self, current_version: int) -> list[Trajectory] | None:
        if self._closed:
            raise BufferClosed("the rollout buffer is closed") from self._close_error
        self._advance(current_version)
        groups = self.config.batch_size // self.config.group_size
        if len(self._queue) < groups or not self._budget_filled():
            return None
        if self.config.fill_staleness_budget:
            # Nothing is in flight now (the whole budget is queued): take the groups in the
            # order they were admitted, not the order they finished in, so which rollouts form
            # a batch does not depend on timing (with seeded sampling a run at any lag is then
            # reproducible, and the oldest version still goes first).
            self._queue = deque(sorted(self._queue, key=_admission_number))
        # The queue holds only fresh groups (see _is_fresh), so FIFO order is kept.
        batch = [t for _ in range(groups) for t in self._queue.popleft()]
        if self.config.stale_policy == "mask_stale_tokens":
            batch = self._mask_stale(batch, current_version)
        for trajectory in batch:
            self._lag_histogram[current_version - trajectory.oldest_version] += 1
        self._counts.consumed += len(batch)
        self._consumed_at_version += len(batch)
        self._changed()
        return batch

    def _mask_stale(self, batch: list[Trajectory], current_version: int) -> list[Trajectory]:
        """The batch with every policy token older than max_lag made context; the queue is
        fresh at current_version (`_is_fresh`), so each member keeps at least one token."""
        masked = [mask_stale_tokens(t, current_version - self.config.max_lag) for t in batch]
        self._counts.stale_tokens_masked += sum(t.num_policy_tokens for t in batch) - sum(
            m.num_policy_tokens for m in masked
        )
        return masked

    def _budget_filled(self) -> bool:
        """With fill_staleness_budget, whether all that admission allows at this version is
        queued (then nothing is in flight, and the oldest queued batch is max_lag versions
        old once the run is max_lag steps in); always True without it."""
        if not self.config.fill_staleness_budget:
            return True
        queued = len(self._queue) * self.config.group_size
        return queued + self._consumed_at_version >= self.config.staleness_budget

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

    def _is_fresh(self, members: list[Trajectory]) -> bool:
        """INVARIANT (the lag bound): every queued trajectory has
        oldest_version >= version - max_lag (drop_trajectory), or
        newest_version >= version - max_lag (mask_stale_tokens, whose batches then lose the
        tokens older than that: `_mask_stale`). It is checked when a group completes and
        re-established for the whole queue whenever the version grows; batches are taken from
        the queue at the current version, so no batch holds a policy token with lag > max_lag.
        A group is as old as its oldest member."""
        if self.config.stale_policy == "mask_stale_tokens":
            age = min(newest_version(t) for t in members)
        else:
            age = min(t.oldest_version for t in members)
        return age >= self._version - self.config.max_lag

    def _drop_stale(self) -> None:
        fresh: deque[list[Trajectory]] = deque()
        for members in self._queue:
            if self._is_fresh(members):
                fresh.append(members)
            else:
                self._drop(members)
        self._queue = fresh

    # ---- closing and waiting ----------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """End the buffer's life: admission stops (admit returns None) and the learner's wait
        for a batch raises BufferClosed, chained to `error` (what ended the run) if given."""
        with self._cond:
            if not self._closed:
                self._closed, self._close_error = True, error
            self._changed()

    @property
    def closed(self) -> bool:
        return self._closed

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

    def take_lengths(self) -> LengthRecord:
        """The response lengths generated and dropped as stale since the previous call (the
        run's report takes them once a step); the record starts afresh."""
        with self._cond:
            taken, self._lengths = self._lengths, LengthRecord()
            return taken

    def stats(self) -> dict[str, Any]:
        """Occupancy and totals; lag = version at consumption - oldest_version (None before
        the first batch)."""
        with self._cond:
            lags = self._lag_histogram
            consumed = sum(lags.values())
            lag_mean = sum(lag * n for lag, n in lags.items()) / consumed if consumed else None
            return {
                "version": self._version,
                "occupancy": len(self._queue) * self.config.group_size,
                "held": self._held,
                "in_flight": len(self._slot_group),
                "requeued_pending": self._source.requeued_count,
                **{f"{name}_total": count for name, count in asdict(self._counts).items()},
                "rejected_reasons": dict(self._rejected_reasons),
                "lag_histogram": dict(sorted(lags.items())),
                "lag_mean": lag_mean,
                "lag_max": max(lags) if lags else None,
            }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot for checkpoint/resume. Groups not yet queued are lost
        with the process: their problems are saved at the front of the re-queue (forming
        groups' rollouts counted abandoned / discarded on load)."""
        with self._cond:
            interrupted = [
                {
                    "problem": g.admission.problem,
                    "in_flight": len(g.in_flight),
                    "done": len(g.done),
                    "failed": g.failed,
                }
                for g in self._groups.values()
            ]
            return {
                "format": STATE_FORMAT,
                "version": self._version,
                "consumed_at_version": self._consumed_at_version,
                "next_group_number": self._peek_group_number(),
                "source": self._source.state_dict(),
                "queued": [[t.to_dict() for t in members] for members in self._queue],
                "interrupted": interrupted,
                "counters": asdict(self._counts),
                "rejected_reasons": dict(self._rejected_reasons),
                "lag_histogram": sorted(self._lag_histogram.items()),
            }

    def _peek_group_number(self) -> int:
        number = next(self._group_numbers)
        self._group_numbers = itertools.count(number)
        return number

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict() into a fresh buffer."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"buffer state format {state.get('format')!r} != {STATE_FORMAT}")
        queued = [
            [validate_trajectory(Trajectory.from_dict(row)) for row in members]
            for members in state["queued"]
        ]
        size = self.config.group_size
        if any(len(members) != size for members in queued):
            raise ValueError(f"buffer state holds groups of another size than group_size {size}")
        if len(queued) * size > self.config.capacity:
            raise ValueError(
                f"buffer state holds {len(queued) * size} queued trajectories, more than "
                f"capacity {self.config.capacity}"
            )
        with self._cond:
            if self._counts.admitted:
                raise RuntimeError("load_state_dict needs a fresh buffer (nothing admitted yet)")
            self._version = state["version"]
            self._consumed_at_version = state["consumed_at_version"]
            self._group_numbers = itertools.count(state["next_group_number"])
            self._source.load_state_dict(state["source"])
            self._queue = deque(queued)
            self._counts = _Counters(**state["counters"])
            self._rejected_reasons = Counter(state["rejected_reasons"])
            self._lag_histogram = Counter({lag: n for lag, n in state["lag_histogram"]})
            for group in reversed(state["interrupted"]):
                self._counts.abandoned += group["in_flight"]
                self._counts.discarded += group["done"]
                if not group["failed"]:  # a failed group's problem is already re-queued
                    self._source.requeue_first([group["problem"]])
                    self._counts.requeued += 1
            # A smaller max_lag than the saved run's may leave queued groups too old.
            self._drop_stale()
            self._changed()


def _admission_number(members: list[Trajectory]) -> int:
    """A queued group's place in admission order: n of its "<problem>@<n>#<k>" ids."""
    return int(members[0].prompt_id.rsplit("@", 1)[1].split("#", 1)[0])


def _problem_of(prompt_id: str) -> str:
    """ "<problem>@<n>#<k>" -> "<problem>" (problem ids may hold "@" themselves)."""
    return prompt_id.rsplit("@", 1)[0]
