"""Push the learner's weights to the inference engines after an optimizer step.

Protocol, run by every learner rank together (resharding exchanges shards between them):
  0. once (connect): rank 0 asks each engine its layout (GET /server_info: SGLang's TP size,
     the ranks it has in a weight-update group), clears what a learner that died left on it
     (below), and every rank gets the answer; then each stage's sending rank (TP 0, DP 0)
     connects its transport, one stage after the other;
  1. rank 0 pauses every engine (/pause_generation; mode "abort" ends in-flight requests,
     which the rollout client continues under the new version) and, for the broadcast and
     tensor transports, opens SGLang's weight-update session (/begin_weight_update);
  2. the stages stream their buckets ONE STAGE AFTER THE OTHER: an SGLang scheduler serves
     one update call at a time, so two stages broadcasting at once to several engines could
     each hold one engine while waiting for the other (a deadlock). Within a stage the
     sender sends bucket k on a second thread while the stage builds bucket k + 1
     (weights/pipeline.py; config.overlap);
  3. rank 0 commits (disk: reload), closes the session (/end_weight_update), empties the
     engines' prefix caches (/flush_cache, so no KV of the old weights is reused), sets the
     new weight version, optionally reads a few tensors back (CPU engine only) and resumes
     generation (/continue_generation).
The pause, the version, the cache flush and the resume are the engines' wire's
(engine/wire.py; vLLM: /pause, /update_weight_version, /reset_prefix_cache, /resume), the
session and the push the transport's, through the same wire (vLLM's transports:
engine/vllm/backend.py); so are connect's clean-up and the read-back. Every engine call
has a deadline. If any step fails the error names the engine and step and
the engines stay paused: they hold weights from two versions, and serving them would put
mixed-version tokens into training data.

Connect is idempotent against long-lived engines (given by URL, outliving a learner that was
killed and restarted). A learner that died mid-sync leaves them paused, with an update session
open (SGLang's /begin_weight_update then refuses to open another) and members of its weight-
update groups. So connect ends any session that may be open (/end_weight_update; "none open" is
fine) and destroys the groups the previous start recorded in GROUPS_FILE, and every connect
forms its groups under fresh names (weight_update_group_<tag>_pp<stage>_e<engine>, a group per
engine and stage, the tag drawn by rank 0): torch refuses a second group of a name it holds, and
SGLang answers that with 400.

A session call is never sent to an engine that serves: SGLang 0.5.23 runs begin/end on an
unpaused engine under model_update_lock's writer lock (tokenizer_control_mixin.py:
_weight_update_session_call), which waits for every generation in flight (each /generate
holds the reader lock to its end) and holds up every new one meanwhile; an engine with a long
generation would miss the regroup bound and be taken out as dead. So connect sends no session
call to an engine this sync closed its session on last (a reconnect to engines that stay in
the pool after a finished sync: nothing of theirs is open), and pauses every other engine
(weights.pause_mode) before ending its session. The paused engines resume at the end of the
sync that follows every connect (the learner runs it right after connect; pool_sync.py after
every reconnect), never before: until then an engine a learner left mid-sync may hold the
weights of two versions.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Self

import torch
import torch.distributed as dist

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.convert.shard import groups_or_megatron
from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.http import EngineRequestError
from megatron_fr.engine.wire import EngineWire
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.weights.pipeline import BucketSender
from megatron_fr.weights.plan import ReshardPlan, build_plan
from megatron_fr.weights.reshard import Bucket, reshard_buckets
from megatron_fr.weights.transports import Engine, WeightTransport, build_transport
from megatron_fr.weights.transports.base import resolve_engine

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

GROUPS_FILE = "weight_groups.json"
"""In the run directory: the names of the weight-update groups the engines joined at the latest
connect, which the next connect destroys (module docstring)."""


class WeightSyncError(RuntimeError):
    pass


class SyncInterrupted(WeightSyncError):
    """The sync was given up on request (a stop) while rank 0 waited on engines' answers: the
    engines may be left paused with an update session open, which the next connect ends."""


INTERRUPTED = "interrupted: a stop was requested while the sync waited on the engines"
"""The failure message `_attempt` reports for SyncInterrupted, so every rank raises it."""
INTERRUPT_POLL_S = 0.5


@dataclass(frozen=True)
class SyncReport:
    """One sync, on every rank: totals over all stages; spot_checked tensors (rank 0's, from
    stage 0) read back from every engine."""

    version: str
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    spot_checked: int


def is_stage_sender(groups: ProcessGroupCollection | None = None) -> bool:
    """The one rank per pipeline stage that hands the stage's tensors to the transport
    (`groups`: the learner's; megatron's when not given)."""
    groups = groups_or_megatron(groups)
    return groups.tp.rank() == 0 and groups.dp_cp.rank() == 0


class WeightSync:
    def __init__(
        self,
        config: WeightSyncConfig,
        engines: list[Engine],
        spec: HFModelSpec,
        groups_file: Path | None = None,
        groups: ProcessGroupCollection | None = None,
    ):
        if not engines:
            raise ValueError("the weight sync needs at least one engine")
        self.config, self.engines, self.spec = config, engines, spec
        self.groups_file = groups_file
        """Where the group names are recorded for the next connect (None: nowhere)."""
        self._groups = groups
        self.bucket_bytes = config.bucket_mib * 2**20
        self.timeout_s = config.timeout_s
        self.transport: WeightTransport | None = None
        self._plan: tuple[torch.nn.Module, ReshardPlan] | None = None
        self.closed: set[str] = set()
        """Rank 0: the engines whose update session this sync closed last (module docstring):
        none of theirs is open, so a reconnect sends them no session call."""
        self.unresponsive: set[str] = set()
        """Rank 0: engines that did not answer a connect within weights.regroup_timeout_s
        since the caller last took them (take_unresponsive); the pool takes them out."""
        self.interrupted: Callable[[], bool] = lambda: False
        """Rank 0: asked every INTERRUPT_POLL_S while the sync waits on the engines' HTTP
        answers (pause, version, resume); True gives the sync up (SyncInterrupted on every
        rank), so a stop is not held for weights.timeout_s by an engine that hangs."""

    @classmethod
    def from_config(
        cls,
        config: WeightSyncConfig,
        engines: list[Engine],
        spec: HFModelSpec,
        groups_file: Path | None = None,
        groups: ProcessGroupCollection | None = None,
    ) -> Self:
        return cls(config, engines, spec, groups_file, groups)

    @property
    def groups(self) -> ProcessGroupCollection:
        """The learner's process groups it syncs from: those given, else megatron's (looked up
        at the first connect: the sync is made before anything needs them)."""
        self._groups = groups_or_megatron(self._groups)
        return self._groups

    def connect(self) -> None:
        """Once per run, on every learner rank (only rank 0 and the stage senders talk to the
        engines); sync() calls it if nobody did."""
        rank0 = dist.get_rank() == 0
        resolved: list[Engine] = []
        failure = self._attempt(rank0, "adopt engines", lambda: resolved.extend(self._adopt()))
        _raise_if_any(failure)
        box: list[object] = [resolved, uuid.uuid4().hex[:8]]
        dist.broadcast_object_list(box, src=0)
        engines, tag = box[0], box[1]
        assert isinstance(engines, list)
        transport = build_transport(self.config, engines, f"weight_update_group_{tag}")
        try:
            self._check_spot_check(engines)
            transport.check_engines()
        except ValueError as error:  # the same engines on every rank: all raise alike
            raise WeightSyncError(f"weight sync refused: {error}") from None
        stage, stages = self.groups.pp.rank(), self.groups.pp.size()
        names = transport.group_names(stages)
        _raise_if_any(self._attempt(rank0, "record groups", lambda: self._record(names)))
        sender = is_stage_sender(self.groups)
        for turn in range(stages):
            mine = sender and stage == turn
            failure = self._attempt(mine, f"connect {turn}", lambda: transport.connect(stage))
            _raise_if_any(failure)
        self.engines, self.transport = engines, transport

    def _adopt(self) -> list[Engine]:
        """Rank 0: the engines resolved, each with no update session open (those that may
        have one paused first) and none of the groups GROUPS_FILE names (module docstring),
        all at once and within
        regroup_timeout_s: an engine that does not answer in time is recorded in
        `unresponsive` and the connect fails naming it (the pool then takes it out)."""
        leftovers = _recorded_groups(self.groups_file)
        bound = self._regroup_bound()
        pool = ThreadPoolExecutor(max_workers=len(self.engines))
        calls = [pool.submit(self._adopt_one, engine, leftovers) for engine in self.engines]
        pool.shutdown(wait=False)  # a hung call's thread is not waited for
        engines, mute = [], []
        deadline = time.monotonic() + bound
        for engine, call in zip(self.engines, calls, strict=True):
            try:
                engines.append(call.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                mute.append(engine.url)
            except EngineRequestError as error:
                if error.status is not None:  # it answered, with an error: not a dead engine
                    raise
                mute.append(engine.url)
        if mute:
            self.unresponsive.update(mute)
            raise EngineRequestError(
                f"engines {mute} did not end their update session and leave their old weight "
                f"groups within {bound:g} s "
                "(weights.regroup_timeout_s, at most weights.timeout_s): treated as dead"
            )
        return engines

    def _regroup_bound(self) -> float:
        return min(self.config.regroup_timeout_s, self.timeout_s)

    def _adopt_one(self, engine: Engine, leftovers: list[str]) -> Engine:
        bound = self._regroup_bound()
        resolved = resolve_engine(engine, bound)
        session = engine.url not in self.closed  # a session may be open: end it, paused
        wire = backend_for(resolved.kind).wire
        wire.release(engine.url, leftovers, session, self.config.pause_mode, bound)
        return resolved

    def take_unresponsive(self) -> list[str]:
        """Rank 0: the engines found not answering since the last call (and forget them)."""
        urls, self.unresponsive = sorted(self.unresponsive), set()
        return urls

    def _record(self, names: list[str]) -> None:
        """Rank 0: the groups this connect forms, written before any engine joins them."""
        if self.groups_file is not None:
            partial = self.groups_file.with_suffix(".partial")
            partial.write_text(json.dumps({"groups": names}) + "\n")
            partial.replace(self.groups_file)

    def _check_spot_check(self, engines: list[Engine]) -> None:
        """weights.spot_check needs engines that read the model's weights back: ValueError
        naming the ones that cannot (told apart by kind once they answered)."""
        if not self.config.spot_check:
            return
        refusals: dict[str, list[str]] = {}
        for engine in engines:
            if engine.kind is None:  # not identified: nothing to go by
                continue
            refusal = backend_for(engine.kind).readback_refusal(self.spec.model_type)
            if refusal:
                refusals.setdefault(refusal, []).append(engine.url)
        if refusals:
            refusal, urls = next(iter(refusals.items()))
            raise ValueError(
                f"spot_check {self.config.spot_check}: {refusal}, and {urls} are such "
                "servers: set weights.spot_check=0 (the sync check, weights.verify_every, "
                "checks them by their log-probs)"
            )

    def sync(self, model: torch.nn.Module, version: str | int) -> SyncReport:
        """Every learner rank calls this; all of them return, or all raise WeightSyncError."""
        if self.transport is None:
            self.connect()
        version, started = str(version), time.monotonic()
        plan = self._plan_for(model)  # before the pause: the engines serve meanwhile
        rank0, sender = dist.get_rank() == 0, is_stage_sender(self.groups)
        _raise_if_any(self._attempt(rank0, "pause", self._pause))
        stage, stages = self.groups.pp.rank(), self.groups.pp.size()
        counts = [0, 0, 0]
        kept: list[tuple[str, torch.Tensor]] = []
        for turn in range(stages):
            failure = None
            if stage == turn:
                failure = self._send_stage(model, plan, sender, counts, kept)
            _raise_if_any(failure)
        failure = self._attempt(rank0, "commit", lambda: self._commit(version, kept))
        _raise_if_any(failure)
        nothing: tuple[list[int], int] = ([0, 0, 0], 0)  # a rank that sent nothing
        per_rank = [nothing] * dist.get_world_size()  # all_gather_object fills every entry
        dist.all_gather_object(per_rank, (counts, len(kept)) if sender else nothing)
        buckets, tensors, nbytes = (sum(c[i] for c, _ in per_rank) for i in range(3))
        seconds = time.monotonic() - started
        return SyncReport(version, buckets, tensors, nbytes, seconds, per_rank[0][1])

    def _plan_for(self, model: torch.nn.Module) -> ReshardPlan:
        """The stage's reshard plan, built at the first sync of `model` (a collective over
        its stage), by every rank; a layout it refuses makes every rank raise."""
        if self._plan is None or self._plan[0] is not model:
            try:
                plan = build_plan(model, self.spec, self.bucket_bytes, self.groups)
            except ValueError as error:
                _raise_if_any(f"rank {dist.get_rank()} at plan: {error}")  # raises everywhere
                raise
            _raise_if_any(None)
            self._plan = (model, plan)
        return self._plan[1]

    def _send_stage(
        self,
        model: torch.nn.Module,
        plan: ReshardPlan,
        sender: bool,
        counts: list[int],
        kept: list[tuple[str, torch.Tensor]],
    ) -> str | None:
        """This stage's buckets: every rank of the stage takes part in building them, its
        sender gets them and sends each one while the next is built."""
        buckets = reshard_buckets(model, plan, self.spec)  # only the sender gets any
        with BucketSender(self._send_bucket, overlap=self.config.overlap) as stream:
            for bucket in buckets:
                keep = self.config.spot_check - len(kept) if dist.get_rank() == 0 else 0
                kept += [(n, t.flatten()[:8].clone()) for n, t in bucket[: max(keep, 0)]]
                counts[0] += 1  # [buckets, tensors, bytes] of this stage
                counts[1] += len(bucket)
                counts[2] += sum(t.numel() * t.element_size() for _, t in bucket)
                stream.submit(bucket)
                del bucket  # else it stays alive while the next one is built: three in memory
            failure = stream.finish()
        if failure is None:
            failure = self._attempt(sender, "finish", self._connected().finish_stage)
        return failure

    def _send_bucket(self, bucket: Bucket) -> str | None:
        return self._attempt(True, "send", lambda: self._connected().send(bucket))

    @property
    def wire(self) -> EngineWire:
        """How the engines are paused, labelled and resumed (one kind per run)."""
        return backend_for(self.engines[0].kind).wire

    def _pause(self) -> None:
        mode = self.config.pause_mode
        self._each_engine(lambda url: self.wire.pause(url, mode, self.timeout_s))
        self.closed.clear()  # from here until end() answers, a session may be open
        self._connected().begin()

    def _commit(self, version: str, kept: list[tuple[str, torch.Tensor]]) -> None:
        transport = self._connected()
        transport.commit(version)
        transport.end()
        self.closed = {engine.url for engine in self.engines}
        if self.config.flush_cache:
            for url in transport.urls:
                self.wire.flush_cache(url, self.timeout_s)
        self._each_engine(lambda url: self.wire.set_version(url, version, self.timeout_s))
        self._check(kept)
        self._each_engine(lambda url: self.wire.resume(url, self.timeout_s))

    def _connected(self) -> WeightTransport:
        """The transport connect() made; every step after connect() goes through it."""
        if self.transport is None:
            raise WeightSyncError("the weight sync is not connected (connect() first)")
        return self.transport

    def _each_engine(self, call: Callable[[str], None]) -> None:
        """`call` for every engine at once; raises the first failure after all finished, or
        SyncInterrupted as soon as `interrupted()` says so. Each call runs on a daemon thread:
        one left hanging on a stopped engine holds neither the stop nor the process's exit."""
        failures: dict[str, BaseException] = {}

        def run(url: str) -> None:
            try:
                call(url)
            except BaseException as error:  # raised in the caller's thread below
                failures[url] = error

        threads = [
            threading.Thread(target=run, args=(engine.url,), name=f"sync {engine.url}", daemon=True)
            for engine in self.engines
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(INTERRUPT_POLL_S)
            while thread.is_alive():
                if self.interrupted():
                    raise SyncInterrupted(INTERRUPTED)
                thread.join(INTERRUPT_POLL_S)
        for engine in self.engines:
            if engine.url in failures:
                raise failures[engine.url]

    @staticmethod
    def _attempt(this_rank: bool, what: str, call: Callable[[], object]) -> str | None:
        """Run call on the ranks it concerns; the failure as a message (None if it worked)."""
        if not this_rank:
            return None
        try:
            call()
        except SyncInterrupted:
            return INTERRUPTED
        except (EngineRequestError, WeightSyncError, RuntimeError, TimeoutError, OSError) as error:
            return f"rank {dist.get_rank()} at {what}: {error}"
        return None

    def _check(self, kept: list[tuple[str, torch.Tensor]]) -> None:
        """Read the first values of a few sent tensors back from every engine, bitwise."""
        for name, expected in kept:
            for url in self._connected().urls:
                served = self.wire.read_weights(url, name, expected.numel(), self.timeout_s)
                if torch.tensor(served, dtype=torch.float32).tolist() != expected.float().tolist():
                    raise WeightSyncError(
                        f"spot check: {url} serves {name} = {served}, sent {expected.tolist()}"
                    )

    def reconnect(self, engines: list[Engine], master_port: int) -> None:
        """On every rank, when the pool changed (rollout/supervisor.py): the senders leave
        their groups without calling the engines, then all connect to `engines` under fresh
        group names, hosted on `master_port` (connect destroys the old groups, recorded in
        GROUPS_FILE, on the engines that stay)."""
        if self.transport is not None and is_stage_sender(self.groups):
            self.transport.leave()
        self.transport = None
        self.engines = engines
        self.config = self.config.model_copy(update={"master_port": master_port})
        self.connect()

    def close(self) -> None:
        """At the end of the run, on every rank: the stage senders leave their groups."""
        if self.transport is not None and is_stage_sender(self.groups):
            self.transport.close()
        self.transport = None


def _recorded_groups(path: Path | None) -> list[str]:
    """The group names GROUPS_FILE holds (none when there is no file)."""
    if path is None or not path.exists():
        return []
    try:
        names = json.loads(path.read_text())["groups"]
    except (ValueError, KeyError, TypeError) as error:
        raise WeightSyncError(
            f"{path}: not a record of weight-update groups ({error}); delete it (the groups "
            "it named then stay on the engines)"
        ) from None
    return [str(name) for name in names]


def _raise_if_any(failure: str | None) -> None:
    """A sync point of all learner ranks: every rank raises if any rank failed."""
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    messages = [message for message in failures if message]
    if INTERRUPTED in messages:
        raise SyncInterrupted(INTERRUPTED)
    if messages:
        raise WeightSyncError("weight sync failed: " + "; ".join(messages))
