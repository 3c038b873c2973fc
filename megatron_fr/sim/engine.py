"""The discrete-event simulation of a run: rollouts, the real LagAwareBuffer, the learner loop.

    rollout side (as rollout/service.py)              learner side (as orchestrator/controller.py)
    admit a group of G rollouts (buffer.try_admit)     waiting: buffer.next_batch(v) -> B fresh
      -> each to the least-loaded server (servers.py)  training: step_seconds(batch lengths)
      -> decode at r(c) until its length is reached    syncing: every server paused; requests
      -> buffer.put(trajectory: first, last version)       aborted, continued after it
                                                       v += 1, buffer.set_version(v)

The buffer IS buffer/lag_buffer.py's LagAwareBuffer, fed trajectories that carry only what its
rules read (the prompt id, the first and the last policy versions), so admission, staleness
drops and the lag histogram follow the production rules exactly, under either stale_policy;
simulated time only decides when each call happens. How many of a trained rollout's tokens
mask_stale_tokens makes context is counted here, from the tokens it had decoded by the end
of each version (Request.decoded_by_version). Events at equal times run in the order they
were scheduled.

A scheme is a buffer config (its group size included): FlashREINFORCE is G = 1, max_lag > 0;
synchronous GRPO is G rollouts per prompt with max_lag = 0 and capacity B, under which the
buffer admits exactly one batch per version, so generation waits for the learner and the
learner for the whole batch (no overlap, lag 0).

Left out: rewards, tool calls and environments take no time; lengths are drawn independently,
within a GRPO group too (whose rollouts in fact share a prompt and often a length); each
rollout of a group prefills the shared prompt (SGLang's prefix cache would share it);
evaluation and checkpoint pauses and failed requests do not happen.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.config.buffer import BufferConfig
from megatron_fr.sim.config import SchemeSettings, SimConfig
from megatron_fr.sim.costs import DecodeModel, LearnerCost, sync_seconds
from megatron_fr.sim.lengths import LengthSampler, build_sampler
from megatron_fr.sim.servers import DecodeServer, Dispatcher, Request


@dataclass(frozen=True)
class Scheme:
    name: str
    buffer: BufferConfig

    @property
    def group_size(self) -> int:
        return self.buffer.group_size


def flash_reinforce(settings: SchemeSettings) -> Scheme:
    b, lag = settings.batch_size, settings.max_lag
    buffer = BufferConfig(
        batch_size=b,
        max_lag=lag,
        capacity=settings.capacity or (lag + 1) * b,
        max_in_flight=settings.max_in_flight,
        stale_policy=settings.stale_policy,
    )
    return Scheme("flash_reinforce", buffer)


def grpo_sync(settings: SchemeSettings) -> Scheme:
    b = settings.batch_size
    buffer = BufferConfig(batch_size=b, max_lag=0, capacity=b, group_size=settings.grpo_group_size)
    return Scheme("grpo_sync", buffer)


SCHEMES = {"flash_reinforce": flash_reinforce, "grpo_sync": grpo_sync}


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step in simulated seconds: the learner waited from `ready_s` (the end of
    the previous sync) to `batch_s`, trained until `trained_s`, synced until `synced_s`."""

    step: int
    ready_s: float
    batch_s: float
    trained_s: float
    synced_s: float
    lags: tuple[int, ...]
    tokens: int
    """Tokens of the batch, prompts included."""


Batch = tuple[float, tuple[int, ...], int]
"""The batch being trained on and synced, carried by those two events: (time taken, lags,
tokens)."""


class SimulationStalled(RuntimeError):
    """Nothing can happen any more, yet the learner still waits for a batch."""


@dataclass
class Totals:
    """Counters read at the end of warm-up and at the end, to report the difference."""

    time: float = 0.0
    decoded_tokens: float = 0.0
    busy_s: float = 0.0
    running_s: float = 0.0
    completed: int = 0
    dropped: int = 0
    wasted_tokens: float = 0.0
    """Response tokens of dropped rollouts, and of trained ones made context as too old."""
    masked_tokens: float = 0.0
    """The second part alone (buffer.stale_policy mask_stale_tokens)."""
    lag_histogram: dict[int, int] = field(default_factory=dict)


class Simulation:
    def __init__(self, config: SimConfig, scheme: Scheme, lengths: LengthSampler | None = None):
        self.config, self.scheme = config, scheme
        self.lengths = lengths or build_sampler(config.lengths, config.seed)
        decode = DecodeModel.from_settings(config.server)
        s = config.server
        self.servers = [
            DecodeServer(i, decode, s.max_running_requests, s.prefill_tokens_per_s)
            for i in range(config.servers)
        ]
        self.dispatcher = Dispatcher(self.servers)
        # Problems are only names to the buffer; enough of them that epochs never matter.
        problems = PromptSource([f"q{i}" for i in range(4096)], seed=config.seed)
        self.buffer = LagAwareBuffer(scheme.buffer, problems)
        self.learner = LearnerCost(config.learner, config.learner_gpus)
        self.sync_s = sync_seconds(config.sync, config.learner.model)
        self.now, self.version = 0.0, 0
        self.steps: list[StepRecord] = []
        self.requests: dict[str, Request] = {}
        """Rollouts admitted and not yet trained on or dropped."""
        self.totals = Totals()
        self.warm: Totals | None = None
        """Totals at the end of warm-up, and at the end of the last step."""
        self.end: Totals | None = None
        self._events: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()
        self._ids = itertools.count()
        self._admitted_at: dict[str, int] = {}
        """Admission order of each rollout (aborted rollouts are resent in it)."""
        self._members: dict[str, tuple[str, ...]] = {}
        """Each admitted rollout -> all rollouts of its group (the buffer drops groups whole)."""
        self._queued: set[str] = set()
        """Rollouts of complete groups waiting in the buffer's queue."""
        self._learner = "waiting"
        self._ready_s = 0.0
        self._trained_s = 0.0
        self._aborted: list[Request] = []
        """Requests ended by the pause of the sync in progress, continued after it."""

    @property
    def in_flight(self) -> int:
        """Rollouts admitted and not yet handed to the buffer: decoding or waiting on a server,
        or held across a sync."""
        return sum(server.outstanding for server in self.servers) + len(self._aborted)

    @property
    def learner_state(self) -> str:
        """waiting (for a batch), training or syncing."""
        return self._learner

    # --- the loop ------------------------------------------------------------------------

    def run(self) -> Simulation:
        if self.config.warmup_steps == 0:
            self.warm = self._snapshot()
        self._admit()
        self._take_batch()
        while len(self.steps) < self.config.steps:
            if not self._events:
                raise SimulationStalled(
                    f"at t={self.now:.1f}s, step {len(self.steps)}: the learner waits for a batch "
                    f"but nothing is generating; buffer {self.buffer.stats()}"
                )
            self.now, _, kind, payload = heapq.heappop(self._events)
            getattr(self, f"_on_{kind}")(payload)
        return self

    def _schedule(self, delay: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._events, (self.now + delay, next(self._order), kind, payload))

    def _reschedule(self, server: DecodeServer) -> None:
        server.epoch += 1
        when = server.next_completion(self.now)
        if when is not None:
            heapq.heappush(self._events, (when, next(self._order), "done", (server, server.epoch)))

    # --- rollout side --------------------------------------------------------------------

    def _admit(self) -> None:
        """Admit groups while the buffer allows (the rollout service: a group's G rollouts
        are admitted, and start, together)."""
        while (admission := self.buffer.try_admit()) is not None:
            for rollout_id in admission.prompt_ids:
                self._members[rollout_id] = admission.prompt_ids
                self._admitted_at[rollout_id] = next(self._ids)
                self._dispatch(rollout_id)

    def _dispatch(self, rollout_id: str) -> None:
        length = self.lengths.draw()
        request = Request(rollout_id, length.prompt_tokens, length.response_tokens)
        self.requests[rollout_id] = request
        self._send(request)

    def _send(self, request: Request) -> None:
        server = self.dispatcher.pick()
        server.add(request, self.now, self.version)
        self._reschedule(server)

    def _on_done(self, payload: tuple[DecodeServer, int]) -> None:
        server, epoch = payload
        if epoch != server.epoch:
            return
        request = server.finish_next(self.now, self.version)
        self.dispatcher.update(server)
        self._reschedule(server)
        self.totals.completed += 1
        outcome = self.buffer.put(_trajectory(request, self.version))
        if outcome == "queued":
            self._queued.update(self._members[request.rollout_id])
        elif outcome == "dropped":
            self._forget(self._members[request.rollout_id])
        self._admit()
        self._take_batch()

    def _forget(self, rollout_ids: Iterable[str]) -> None:
        """Rollouts the buffer dropped as too old: their tokens were generated for nothing."""
        for rollout_id in rollout_ids:
            request = self.requests.pop(rollout_id)
            self._members.pop(rollout_id)
            self._admitted_at.pop(rollout_id)
            self._queued.discard(rollout_id)
            self.totals.dropped += 1
            self.totals.wasted_tokens += request.response_tokens

    def _forget_dropped_from_queue(self) -> None:
        """After a version bump: the queued groups the buffer dropped as too old."""
        still = {row["prompt_id"] for group in self.buffer.state_dict()["queued"] for row in group}
        self._forget(sorted(self._queued - still))

    # --- learner side --------------------------------------------------------------------

    def _take_batch(self) -> None:
        if self._learner != "waiting":
            return
        batch = self.buffer.next_batch(self.version)
        if batch is None:
            return
        lengths = []
        oldest_allowed = self.version - self.scheme.buffer.max_lag
        for trajectory in batch:
            request = self.requests.pop(trajectory.prompt_id)
            masked = max(
                (n for v, n in request.decoded_by_version if v < oldest_allowed), default=0
            )
            self.totals.masked_tokens += masked
            self.totals.wasted_tokens += masked
            self._members.pop(trajectory.prompt_id)
            self._admitted_at.pop(trajectory.prompt_id)
            self._queued.discard(trajectory.prompt_id)
            lengths.append(request.prompt_tokens + request.response_tokens)
        lags = tuple(self.version - t.oldest_version for t in batch)
        self._learner = "training"
        taken: Batch = (self.now, lags, sum(lengths))
        self._schedule(self.learner.step_seconds(lengths), "trained", taken)
        self._admit()  # the batch left the queue: room under capacity, if that was the limit

    def _on_trained(self, batch: Batch) -> None:
        self._learner = "syncing"
        self._trained_s = self.now
        for server in self.servers:
            aborted = server.abort_all(self.now)
            for request in aborted:
                if request.first_version is not None:  # it has tokens of this version
                    request.decoded_by_version.append((self.version, request.decoded))
            self._aborted.extend(aborted)
            server.epoch += 1
            self.dispatcher.update(server)
        self._schedule(self.sync_s, "synced", batch)

    def _on_synced(self, batch: Batch) -> None:
        batch_s, lags, tokens = batch
        self.steps.append(
            StepRecord(
                len(self.steps) + 1, self._ready_s, batch_s, self._trained_s, self.now, lags, tokens
            )
        )
        self.version += 1
        self.buffer.set_version(self.version)
        self._forget_dropped_from_queue()
        for server in self.servers:
            server.resume(self.now)
        for request in sorted(self._aborted, key=lambda r: self._admitted_at[r.rollout_id]):
            self._send(request)
        self._aborted = []
        if len(self.steps) == self.config.warmup_steps:
            self.warm = self._snapshot()
        if len(self.steps) == self.config.steps:
            self.end = self._snapshot()  # before the next batch is taken: it is not measured
            return
        self._learner, self._ready_s = "waiting", self.now
        self._admit()
        self._take_batch()

    # --- measurement ---------------------------------------------------------------------

    def _snapshot(self) -> Totals:
        for server in self.servers:
            server.advance(self.now)
        stats = self.buffer.stats()
        return Totals(
            time=self.now,
            decoded_tokens=sum(s.decoded_tokens for s in self.servers),
            busy_s=sum(s.busy_s for s in self.servers),
            running_s=sum(s.running_s for s in self.servers),
            completed=self.totals.completed,
            dropped=self.totals.dropped,
            wasted_tokens=self.totals.wasted_tokens,
            masked_tokens=self.totals.masked_tokens,
            lag_histogram=dict(stats["lag_histogram"]),
        )


def _trajectory(request: Request, last_version: int) -> Trajectory:
    """The smallest trajectory the buffer accepts that carries the rollout's first and last
    versions (the buffer's rules read nothing else: the oldest, or with mask_stale_tokens the
    newest); token counts live in Simulation.requests."""
    if request.first_version is None:  # DecodeServer.add sets it; only an abort clears it
        raise RuntimeError(f"rollout {request.rollout_id} finished without a first version")
    versions = [NON_POLICY_VERSION, request.first_version, last_version]
    return Trajectory(
        prompt_id=request.rollout_id,
        token_ids=np.zeros(3, dtype=np.int32),
        action_mask=np.array([False, True, True]),
        behavior_log_probs=np.array([0.0, -1.0, -1.0], dtype=np.float32),
        token_versions=np.array(versions, dtype=np.int32),
        reward=0.0,
    )
