"""The weight sync to a pool of engines that changes while the run goes on.

Before every sync the leader (the first rank: orchestrator/ranks.py) asks the rollout process
who is in the pool (an epoch and the engines serving or joining: rollout/supervisor.py) and
every rank gets the answer; when the epoch moved, the weight sync reconnects to the new members
under fresh group names (weights/sync.py). A sync that fails (an engine died or hung during it)
is tried again, reconnected, once the pool has changed or the engine watch had time to notice,
up to SYNC_TRIES times. An engine that did not leave its old groups within
weights.regroup_timeout_s at the reconnect is taken out of the pool at once (its scheduler is
stuck in the failed collective), so the engines still alive are regrouped under fresh names
within that bound. After a sync, the engines that were joining serve.

While the learner waits (for a batch, an evaluation), the leader looks at the pool every
WAIT_S: an engine that joined meanwhile gets the current weights then, so a pool whose every
engine was out recovers without a step in between (no engine could have generated the batch
or the evaluation the learner waits for), and a STOP request ends the wait. A STOP request
also gives up a sync that waits on an engine's answer (weights/sync.py: SyncInterrupted), so
a hung engine does not hold the stop for weights.timeout_s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from megatron_fr.buffer.trajectory import TrajectorySummary
from megatron_fr.config.run import RunConfig
from megatron_fr.orchestrator.ranks import Follower, Leader, Rank
from megatron_fr.orchestrator.setup import weight_sync_port
from megatron_fr.weights.sync import SyncInterrupted, WeightSyncError
from megatron_fr.weights.transports import Engine

if TYPE_CHECKING:
    from megatron_fr.weights.sync import WeightSync
    from megatron_fr.weights.verify import EngineCheck, SyncCheck

SYNC_TRIES = 3
WAIT_S = 5.0
"""How often the learner, waiting for a batch or an evaluation, looks for engines that joined
the pool and for a STOP request."""
T = TypeVar("T")


class StopRequested(Exception):
    """A STOP file appeared while the learner waited (for a batch, an evaluation): the run
    stops at the step it has reached, which a checkpoint keeps."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stop requested at step {step}")
        self.step = step


class PoolSync:
    """Every learner rank's side of the pool: the weight sync kept connected to its members."""

    def __init__(
        self,
        config: RunConfig,
        weight_sync: WeightSync,
        rank: Rank,
        check: SyncCheck | None = None,
    ) -> None:
        self.config, self.weight_sync, self.rank = config, weight_sync, rank
        if isinstance(rank, Leader):  # a STOP gives up a sync that waits on a hung engine
            weight_sync.interrupted = rank.stop_requested
        self.check = check
        """Checks after a sync that every engine computes the learner's log-probs (None: no
        check); a failed engine leaves the pool."""
        self.checked: list[EngineCheck] = []
        """The leader: the engines' checks of the latest sync that ran one (check_metrics)."""
        self.epoch = 0
        """The pool's epoch the weight sync is connected to (the run starts at 0)."""
        self.seen = 0
        """The latest epoch the leader acted on while waiting for a batch."""

    def sync(self, model: torch.nn.Module, version: int) -> float:
        """Send the weights of `version` to the pool's members, on every rank; the seconds it
        took. WeightSyncError after SYNC_TRIES failed tries; SyncInterrupted, on every rank,
        when a STOP request gave up a try that waited on an engine's answer."""
        reconnect, self.checked = False, []
        for attempt in range(1, SYNC_TRIES + 1):
            epoch, urls = self.rank.membership()
            self.seen = epoch
            if not urls:  # nobody to send to: the engines get the weights when they join
                return 0.0
            try:
                if reconnect or epoch != self.epoch:
                    self._reconnect(epoch, urls)
                seconds = self.weight_sync.sync(model, version).seconds
            except SyncInterrupted:
                raise
            except WeightSyncError as error:
                self._take_out_unresponsive()
                if attempt == SYNC_TRIES:
                    raise
                self._await_pool_change(epoch, error)
                reconnect = True
                continue
            self.rank.synced(urls, version)
            if self.check is not None and self.check.due(version):
                self._verify(urls, version)
            return seconds
        raise AssertionError("unreachable: the last try returns or raises")

    def wait_for_batch(self, step: int, model: torch.nn.Module) -> list[TrajectorySummary]:
        """The leader: the summaries of step's batch (its shares on their way to the
        learners); empty elsewhere. Waited for as `wait` says."""
        summaries = self.wait(lambda lead: lead.rollout.deliver_batch(step, WAIT_S), model, step)
        return summaries or []

    def wait(
        self, look: Callable[[Leader], T | None], model: torch.nn.Module, version: int
    ) -> T | None:
        """Every rank: what `look` finds on the leader (it waits up to WAIT_S itself; None:
        nothing yet), returned on the leader, None on the followers. Between two looks the
        pool is cared for: engines that joined it (restarted, or back) get the weights of
        `version` at once, so a restarted engine serves within seconds, even when it was the
        only one and the leader waits on it (a batch, an evaluation); and a STOP request in
        the run directory ends the wait on every rank (StopRequested)."""
        found: list[T] = []

        def decide(lead: Leader) -> str:
            answer = look(lead)
            if answer is not None:
                found.append(answer)
                return "done"
            if lead.stop_requested():
                return "stop"
            epoch, _ = lead.rollout.membership()
            return "sync" if epoch != self.seen and lead.rollout.joining() else "wait"

        while True:
            decision = self.rank.share(decide)
            if decision == "done":
                return found[0] if found else None
            if decision == "stop":
                raise StopRequested(version)
            if decision == "sync":
                self.sync(model, version)

    def _reconnect(self, epoch: int, urls: list[str]) -> None:
        self.rank.say(f"weight sync: the pool is now {urls} (epoch {epoch})")
        self.weight_sync.reconnect([Engine(url) for url in urls], weight_sync_port(self.config))
        self.epoch = epoch

    def check_metrics(self) -> dict[str, float]:
        """The leader: the latest check's figures for the step's metrics (empty without one): the
        largest and mean per-token gap over the engines that answered, and how many failed."""
        answered = [c for c in self.checked if c.tokens]
        if not self.checked:
            return {}
        out = {"sync_checks_failed": float(sum(c.problem is not None for c in self.checked))}
        if answered:
            out["sync_logprob_gap"] = max(c.gap for c in answered)
            out["sync_logprob_gap_mean"] = sum(c.mean_gap for c in answered) / len(answered)
        return out

    def _verify(self, urls: list[str], version: int) -> None:
        """Every rank: the check after the sync to `urls`; engines that fail it leave the pool,
        each named with its gap."""
        assert self.check is not None
        # The leader probes the engines; a follower takes part in the scoring (SyncCheck.run).
        probed = None if isinstance(self.rank, Follower) else urls
        self.checked = self.check.run(probed, version, self.weight_sync.wire)
        for failed in [c for c in self.checked if c.problem is not None]:  # the leader's
            print(f"weight sync check: {failed.url} {failed.problem}: taken out", flush=True)
            self.rank.take_out([failed.url], f"sync check: {failed.problem}")

    def _take_out_unresponsive(self) -> None:
        """The leader: engines the failed connect found not answering leave the pool, so the
        next try regroups the others at once instead of waiting on them again."""

        def take_out(lead: Leader) -> None:
            mute = self.weight_sync.take_unresponsive()
            if mute:
                bound = self.config.weights.regroup_timeout_s
                cause = f"did not leave its old weight groups within {bound:g} s (wedged)"
                lead.rollout.take_out(mute, cause)

        self.rank.act(take_out)

    def _await_pool_change(self, epoch: int, error: WeightSyncError) -> None:
        """The leader: wait until the pool changed or the watch had time to take a hung
        engine out; the followers wait at the next membership broadcast."""
        settings = self.config.rollout.engine

        def wait(lead: Leader) -> None:
            print(f"{error}; trying again once the pool changed", flush=True)
            bound = settings.unreachable_after_s + 2 * settings.watch_interval_s
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline and lead.rollout.membership()[0] == epoch:
                if lead.stop_requested():  # the next try is given up at once
                    return
                time.sleep(settings.watch_interval_s)

        self.rank.act(wait)
