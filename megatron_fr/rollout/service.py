"""The rollout service: the one owner of everything a run does to produce trajectories.

    RolloutService (in the rollout process, which the first learner rank starts and calls
    through a proxy typed as rollout/control.py's RolloutControl, which it implements:
    orchestrator/rollout_process.py; the learner ranks never hold it)
      ├─ EngineSupervisor   the pool of inference engines (started or adopted): an engine
      │                     that dies or hangs is taken out, restarted or re-admitted
      ├─ LagAwareBuffer     prompt cursor + re-queue + rollout slots + queue, under one lock
      ├─ EpisodeProducer    what a problem is, how it is played and scored
      └─ its thread: one asyncio loop running
             admission ─► group task (G episodes through the RolloutClient) ─► buffer.put
             the engine watch
             evaluation passes (on request)

What waits on what: admission waits on the buffer (its staleness budget and capacity, woken
by the buffer itself, never polled); the learner waits on buffer.get_batch. Nothing is
fire-and-forget: the first exception of any task of the loop (a bug in a reward, an engine
past its restart budget) closes the buffer with that error as the cause, which wakes the
learner's wait with it, and the run ends naming it. A failed generation is not a bug: its
group is discarded whole (handed out again later), counted, and new work waits an exponential
backoff while failures repeat, so a dead or overloaded engine never spins a loop. close()
stops the loop, joins the thread (not a daemon) and closes the loop, so nothing is left
behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from megatron_fr.buffer.lag_buffer import Admission, LagAwareBuffer, LengthRecord
from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.client import RolloutClient, RolloutClientConfig, RolloutError
from megatron_fr.engine.types import MalformedResponse, SamplingParams
from megatron_fr.rollout.episodes import EpisodeFailed, EpisodeProducer
from megatron_fr.rollout.stats import RolloutStats
from megatron_fr.rollout.supervisor import EngineSupervisor

log = logging.getLogger("megatron_fr.rollout")
T = TypeVar("T")

ROLLOUT_FAILURES = (RolloutError, MalformedResponse, EpisodeFailed)
"""What a generation may fail with without it being a bug: counted, the group re-issued."""


@dataclass(frozen=True)
class EvalSet:
    problems: list[str]
    samples: int
    """k: samples per problem; the set's accuracy is avg@k."""


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation measured. An accuracy is reported only for a set whose every
    episode was scored: an episode the pool failed is retried, never scored 0, so an outage
    can make an evaluation incomplete but never lower an accuracy."""

    accuracies: dict[str, tuple[float, float]]
    """{set: (mean, std over the k passes) of avg@k}, for the sets scored in full."""
    failed_episodes: int
    """Episode tries the pool failed (each was retried)."""
    incomplete: str | None = None
    """Why some set has no accuracy (the pool did not serve it by the deadline); None when
    every set was scored."""


@dataclass
class _EvalTally:
    """An evaluation's progress, written by the loop and read by the caller's thread once the
    deadline passed."""

    accuracies: dict[str, tuple[float, float]]
    failed: int = 0
    first_error: BaseException | None = None


@dataclass(frozen=True)
class _RunningEvaluation:
    """An evaluation begun: its task in the loop, its progress and its deadline."""

    future: Future
    tally: _EvalTally
    sets: list[str]
    deadline: float
    """time.monotonic() past which it is taken as it stands (incomplete)."""
    timeout_s: float


class RolloutFailed(RuntimeError):
    """The rollout service stopped; the cause is chained."""


class Backoff:
    """Exponential delay after consecutive failures (reset by a success), and failure logging
    at most once per `log_every_s` with the count since the last line."""

    def __init__(self, base_s: float = 0.05, max_s: float = 5.0, log_every_s: float = 10.0):
        self.base_s, self.max_s, self.log_every_s = base_s, max_s, log_every_s
        self.consecutive = 0
        self.unlogged = 0
        self._last_log = -float("inf")

    def failed(self, what: str, error: BaseException) -> None:
        self.consecutive += 1
        self.unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            log.warning(
                "%d rollout(s) failed in the last %.0f s; latest %s: %s",
                self.unlogged,
                min(now - self._last_log, 1e9),
                what,
                error,
            )
            self._last_log, self.unlogged = now, 0

    def succeeded(self) -> None:
        self.consecutive = 0

    @property
    def delay_s(self) -> float:
        if not self.consecutive:
            return 0.0
        return min(self.max_s, self.base_s * 2 ** (self.consecutive - 1))


class RolloutService:
    def __init__(
        self,
        engines: EngineSupervisor,
        buffer: LagAwareBuffer,
        producer: EpisodeProducer,
        client: RolloutClientConfig,
        sampling: SamplingParams,
    ) -> None:
        self.engines, self.buffer, self.producer = engines, buffer, producer
        self.client_config, self.sampling = client, sampling
        self.completed = 0
        self.failures: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        """completed / failures are written by the loop's thread and read by the learner's."""
        self.backoff = Backoff()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="rollouts")
        self._client: RolloutClient | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._evaluation: _RunningEvaluation | None = None
        """The evaluation begun and not yet taken (begin_evaluation, evaluation_result)."""
        self._failed: Future = Future()
        """Resolved with the first error: what a caller waiting on the loop also waits on,
        since a stopped loop finishes nothing it was given."""

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start generating (after the engines serve the learner's weights)."""
        self._thread.start()
        self._started.wait()
        self.check()

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop generating, join the thread, close the loop, stop the engines we started.
        Safe to call twice and on a service that never started."""
        self.buffer.close(self._error)
        if self._thread.is_alive():
            assert self._stop is not None  # _main makes it before start() returns
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                raise RuntimeError(f"the rollout thread did not stop within {timeout_s} s")
        if not self._loop.is_closed():
            self._loop.close()
        self.engines.stop()
        self.producer.close()

    def check(self) -> None:
        """Raise, in the caller's thread, the error that stopped the service."""
        if self._error is not None:
            raise RolloutFailed(f"rollouts stopped: {self._error}") from self._error

    def explain(self, error: BaseException) -> None:
        """Raise the service's own failure instead of `error` when both come from one cause.

        A dead engine breaks the learner's side too (a weight sync to it fails with a socket
        error that names no engine); the engine watch notices within its interval. So wait up
        to two intervals for the service to fail, and raise RolloutFailed with ITS cause (the
        engine, its exit code, its log) chained; return if it does not fail."""
        wait_s = 2 * self.engines.settings.watch_interval_s + 1.0
        if wait([self._failed], wait_s if self._thread.is_alive() else 0).done:
            raise RolloutFailed(
                f"rollouts stopped: {self._error} (the learner then failed with: {error})"
            ) from self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as error:
            self._fail(error)
        finally:
            self._started.set()

    def _fail(self, error: BaseException) -> None:
        """The first error ends the service: the buffer closes with it as the cause."""
        if self._error is None:
            self._error = error
            self._failed.set_result(error)
            log.error("rollout service failed: %s", error)
        self.buffer.close(self._error)
        if self._stop is not None:
            self._stop.set()

    # --- the loop -------------------------------------------------------------------------

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                self._fail(error)

        async with RolloutClient(self.client_config) as client:
            self._client = client
            self._started.set()
            for job in (self._admissions(tasks, finished), self.engines.watch(client)):
                task = asyncio.create_task(job)
                tasks.add(task)
                task.add_done_callback(finished)
            await self._stop.wait()
            # Every task of the loop ends here, not only the rollouts and the watch: an
            # evaluation under way and the pool's probes and restarts too, so closing the loop
            # destroys no pending task.
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self._client = None

    async def _admissions(
        self, tasks: set[asyncio.Task], finished: Callable[[asyncio.Task], None]
    ) -> None:
        while (admission := await self.buffer.admit_async()) is not None:
            task = asyncio.create_task(self._group(admission))
            tasks.add(task)
            task.add_done_callback(finished)
            if self.backoff.delay_s:
                await asyncio.sleep(self.backoff.delay_s)

    async def _group(self, admission: Admission) -> None:
        await asyncio.gather(*(self._episode(admission, pid) for pid in admission.prompt_ids))

    async def _episode(self, admission: Admission, prompt_id: str) -> None:
        try:
            trajectory = await self.producer.run(
                self._running_client(), admission.problem, prompt_id, admission.group, self.sampling
            )
        except ROLLOUT_FAILURES as error:
            with self._counts_lock:
                self.failures[getattr(error, "reason", type(error).__name__)] += 1
            self.backoff.failed(prompt_id, error)
            self.buffer.abandon(prompt_id)
            return
        self.backoff.succeeded()
        self.buffer.put(trajectory)
        with self._counts_lock:
            self.completed += 1

    def _running_client(self) -> RolloutClient:
        """The loop's client, which exists while the loop runs (start() to close())."""
        if self._client is None:
            raise RuntimeError("the rollout service is not running: start() it first")
        return self._client

    # --- the learner's side ---------------------------------------------------------------

    def next_batch(self, version: int, timeout_s: float | None = None) -> list[Trajectory] | None:
        """The next batch for the learner at `version`, or None when none was ready within
        `timeout_s` (None: wait for it); raises RolloutFailed (with the cause) if the service
        stops meanwhile."""
        self.check()
        try:
            return self.buffer.get_batch(version, timeout_s)
        except Exception:
            self.check()
            raise

    def set_version(self, version: int) -> None:
        self.buffer.set_version(version)

    def membership(self) -> tuple[int, list[str]]:
        """The pool's epoch and the engines the next weight sync must reach (supervisor)."""
        return self._in_loop(self._membership())

    def joining(self) -> list[str]:
        """The engines waiting for a weight sync to serve (supervisor)."""
        return self._in_loop(self._joining())

    async def _joining(self) -> list[str]:
        return self.engines.joining()

    def synced(self, urls: list[str], version: int) -> None:
        """A weight sync reached `urls` at `version`: the joining ones among them serve."""
        self._in_loop(self.engines.synced(urls, str(version)))

    def take_out(self, urls: list[str], cause: str) -> None:
        """Engines the weight sync found not answering within its bound leave the pool."""
        self._in_loop(self.engines.take_out_unresponsive(urls, cause))

    async def _membership(self) -> tuple[int, list[str]]:
        return self.engines.membership()

    def _in_loop(self, job: Coroutine[Any, Any, T]) -> T:
        """Run `job` in the service's loop (which alone changes the pool) and wait for it;
        before start() there is no thread yet, and the loop runs it here."""
        self.check()
        if not self._thread.is_alive():
            return self._loop.run_until_complete(job)
        future = asyncio.run_coroutine_threadsafe(job, self._loop)
        wait([future, self._failed], return_when=FIRST_COMPLETED)
        self.check()
        return future.result()

    # --- state ------------------------------------------------------------------------------

    def stats(self) -> RolloutStats:
        """Rollouts completed (over resumes) and failed by reason, the buffer's figures and
        the engines' (engines_total, and per engine of the pool, engine<i> in its order,
        generate requests sent, failed and timed out since this start, and the requests it
        may have in flight now)."""
        with self._counts_lock:
            completed, failures = self.completed, dict(self.failures)
        buffer = self.buffer.stats()
        return RolloutStats(
            rollouts_total=completed,
            rollout_failures_total=sum(failures.values()),
            rollout_failures=failures,
            occupancy=buffer.pop("occupancy"),
            dropped_total=buffer.pop("dropped_total"),
            stale_tokens_masked_total=buffer.pop("stale_tokens_masked_total"),
            discarded_total=buffer.pop("discarded_total"),
            abandoned_total=buffer.pop("abandoned_total"),
            groups_failed_total=buffer.pop("groups_failed_total"),
            engines=self._engine_stats(),
            buffer=buffer,
        )

    def take_lengths(self) -> LengthRecord:
        return self.buffer.take_lengths()

    def _engine_stats(self) -> dict[str, float]:
        client = self._client
        urls = client.urls if client else list(self.client_config.urls)
        stats: dict[str, float] = {"engines_total": len(urls), **self.engines.stats()}
        for index, url in enumerate(urls):
            stats[f"engine{index}_requests_total"] = client.metrics.requests[url] if client else 0
            stats[f"engine{index}_failures_total"] = client.metrics.failures[url] if client else 0
            stats[f"engine{index}_timeouts_total"] = client.metrics.timeouts[url] if client else 0
            stats[f"engine{index}_in_flight_limit"] = (
                client.in_flight_limit(url) if client else self.client_config.max_in_flight
            )
        return stats

    def state_dict(self) -> dict:
        with self._counts_lock:
            completed, failures = self.completed, dict(self.failures)
        return {"buffer": self.buffer.state_dict(), "completed": completed, "failures": failures}

    def load_state_dict(self, state: dict) -> None:
        """Before start(): the buffer (prompt cursor included) and the counters as saved."""
        self.buffer.load_state_dict(state["buffer"])
        self.completed = state["completed"]
        self.failures = Counter(state["failures"])

    # --- evaluation ---------------------------------------------------------------------

    def evaluate(
        self, sets: dict[str, EvalSet], sampling: SamplingParams, timeout_s: float
    ) -> Evaluation:
        """avg@k of every set, waited for (begin_evaluation, then evaluation_result)."""
        self.begin_evaluation(sets, sampling, timeout_s)
        result = self.evaluation_result(None)
        assert result is not None  # waited without a bound: done, or past its deadline
        return result

    def begin_evaluation(
        self, sets: dict[str, EvalSet], sampling: SamplingParams, timeout_s: float
    ) -> None:
        """Start avg@k of every set: the reward of k samples per problem at the eval sampling
        settings, the spread over the k passes. Episodes the pool fails are retried until
        `timeout_s`; a set not scored in full by then has no accuracy and the evaluation is
        incomplete (an outage is not a wrong answer). The caller looks at it with
        evaluation_result, and may sync weights in between (an engine that joined the pool
        meanwhile then serves the rest of it)."""
        self.check()
        if self._evaluation is not None:
            raise RuntimeError("an evaluation is already under way: take its result first")
        tally = _EvalTally(accuracies={})
        future: Future = asyncio.run_coroutine_threadsafe(
            self._evaluate(sets, sampling, tally), self._loop
        )
        deadline = time.monotonic() + timeout_s
        self._evaluation = _RunningEvaluation(future, tally, list(sets), deadline, timeout_s)

    def evaluation_result(self, wait_s: float | None) -> Evaluation | None:
        """The evaluation begun, once it finished or passed its deadline; None when neither
        happened within `wait_s` (None: wait until one does). Raises RolloutFailed as soon as
        the service fails (an engine past its restart budget), whatever the evaluation was
        waiting for."""
        running = self._evaluation
        if running is None:
            raise RuntimeError("no evaluation is under way: begin_evaluation first")
        left = max(0.0, running.deadline - time.monotonic())
        patience = left if wait_s is None else min(wait_s, left)
        finished = wait([running.future, self._failed], patience, return_when=FIRST_COMPLETED)
        if running.future not in finished.done and time.monotonic() < running.deadline:
            self.check()
            return None
        self._evaluation = None
        if running.future not in finished.done:
            running.future.cancel()
        self.check()  # the service's cause, not what the evaluation saw of it
        tally = running.tally
        if running.future in finished.done:
            running.future.result()  # a bug in an episode is raised
            return Evaluation(dict(tally.accuracies), tally.failed)
        missing = [name for name in running.sets if name not in tally.accuracies]
        reason = (
            f"set(s) {missing} not served within {running.timeout_s:g} s; {tally.failed} "
            f"episode tries failed (first: {tally.first_error})"
        )
        log.warning("evaluation incomplete, no accuracy recorded: %s", reason)
        return Evaluation(dict(tally.accuracies), tally.failed, reason)

    async def _evaluate(
        self, sets: dict[str, EvalSet], sampling: SamplingParams, tally: _EvalTally
    ) -> None:
        client = self._running_client()
        for name, spec in sets.items():
            passes = []
            for k in range(spec.samples):
                rewards = await asyncio.gather(
                    *(
                        self._eval_episode(client, name, problem, k, sampling, tally)
                        for problem in spec.problems
                    )
                )
                passes.append(statistics.fmean(rewards))
            tally.accuracies[name] = (statistics.fmean(passes), statistics.pstdev(passes))

    async def _eval_episode(
        self,
        client: RolloutClient,
        name: str,
        problem: str,
        k: int,
        sampling: SamplingParams,
        tally: _EvalTally,
    ) -> float:
        """One eval episode's reward, retried after a backoff (0.5 s doubling to 10 s) while
        the pool fails it; each failure counted, the evaluation's first one logged. A bug is
        raised."""
        episode_id = f"eval-{name}-{problem}#{k}"
        for tries in itertools.count():
            try:
                outcome = await self.producer.run(client, problem, episode_id, "eval", sampling)
            except ROLLOUT_FAILURES as error:
                with self._counts_lock:
                    self.failures[f"eval {name}"] += 1
                tally.failed += 1
                if tally.first_error is None:
                    tally.first_error = error
                    log.warning("eval episodes of %r failing, retried: %s", name, error)
                await asyncio.sleep(min(10.0, 0.5 * 2**tries))
                continue
            return outcome.reward
        raise AssertionError("unreachable")
