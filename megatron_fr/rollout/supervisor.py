"""The inference engines of a run, supervised: an engine that dies, hangs or stops answering
costs its in-flight work, never the run.

The run's engines are one pool: rollout.engine.count started here (consecutive ports, and for
SGLang consecutive blocks of GPUs), any given by URL in the recipe, and any listed later in
RUN_DIR/engines.txt (one URL a line, read when it changes: the fleet grows without a
restart; rollout/engines_file.py says what a line must be, and a line that is not one is left
out with a "skipped" line in faults.jsonl, never fatal). Before it serves, every engine says
what it is on GET /server_info (engine/server_info.py); one that does not, or that cannot give
the routed experts a routing-replay run needs, is refused with the reason (EngineRefused):
before any step for the recipe's engines, by staying out for the others. The pool's engines
are of one wire: SGLang and the CPU engine, or vLLM (engine/wire.py).

    serving ──(exited; no answer on GET /model_info for unreachable_after_s;
      ▲        failures_in_a_row generate requests failed, timeouts not counted; wedged:
      ▲        no answer for stalled_after_s, nor to a 1-token probe then)───────► out
      ▲            its requests in flight go to the others at once (engine/client.py)
      │
    joining ◄──(started here: restarted after restart_backoff_s x 2^k; by URL: answers again)
      │
      └──(a weight sync reached it and its /model_info weight_version is the learner's: the
          learner syncs as soon as the pool changes while it waits for a batch or an
          evaluation, so a restarted engine serves within seconds: orchestrator/pool_sync.py)

Every change of who is in the pool bumps the membership epoch. The learner asks for it before
each weight sync (membership()); when it moved, every sending rank leaves its weight-update
groups and all join new ones, under fresh names, with the engines serving or joining. A
joining engine is sent requests only after such a sync loaded the current weights into it
(synced()): its KV cache flushed and its version checked. So an engine never serves stale
weights, and the group never waits on a dead member.

A started engine is restarted at most rollout.engine.restarts times; past that the run ends
with EngineDied naming the engine, the cause and its log's tail (restarts 0: the first death
ends the run). A pool with no engine serving, joining or restarting for start_timeout_s ends
the run too. Engines are probed on the wire's version route (engine/wire.py: SGLang's GET
/model_info, vLLM's GET /weight_info; "/model_info" below), never /health: SGLang 0.5.23
runs a generation there unless started with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, which
waits while a weight sync pauses the server and answers 503 after 20 s, so a long sync would
be taken for a death; /model_info is answered without generating. Which is also why it cannot
see a wedged engine: SGLang's HTTP process answers it without the scheduler, so a scheduler
stuck in a collective answers 200 there while its requests hang. The rollout client times the
requests in flight at each engine from its last answer (RolloutClient.stalled_s, which runs
on across timeouts); an engine serving requests that have had none for stalled_after_s gets a
1-token generate request of the watch's own, past the client's queue, and only if that has no
answer within stalled_after_s either is it taken out as wedged, restarted or re-admitted as a
dead one is. Slow is not dead: an engine whose requests time out (a request timeout below its
service time, an overload) still answers the probe, which restarts its stall clock; the
client lowers its requests in flight instead (engine/client.py). So request_timeout_s and
stalled_after_s are independent: lowering the first alone never makes a slow engine wedged.

A URL of the engines file is probed beside the watch, never in its way: at most
rollout.engine.file_probes at once, each given unreachable_after_s to answer /server_info, so a
flood of URLs that never answer does not delay the check of the engines in the pool. It is
left out ("skipped") when it is an engine already in the pool under another spelling: the
same resolved address (loopback and 0.0.0.0 count as this host: localhost, 127.0.0.1 and
0.0.0.0 on one port are one engine) or the same /server_info instance id (the CPU engine's;
SGLang gives none). One that does not answer or cannot serve the run is "refused"; either is
tried again when the file changes.

Each event goes to RUN_DIR/faults.jsonl (time, engine, event, cause) and into the counters of
stats(): engines taken out, restarted and back in, and the engine-seconds lost (time engines
spent out of the pool).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

import aiohttp

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.http import SERVER_INFO_PATH, EngineRequestError, get_json
from megatron_fr.engine.launcher import ServerExited, ServerProcess, launch_server
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.server_info import (
    INFO_QUERY,
    EngineKind,
    ServerInfo,
    identify,
    parse_server_info,
)
from megatron_fr.engine.types import SamplingParams
from megatron_fr.engine.wire import EngineWire
from megatron_fr.rollout.engines_file import EnginesFile
from megatron_fr.utils.net import free_port

if TYPE_CHECKING:
    from megatron_fr.engine.client import RolloutClient

log = logging.getLogger("megatron_fr.rollout")

ENGINES_FILE = "engines.txt"
FAULTS_FILE = "faults.jsonl"
STOP_TIMEOUT_S = 5.0
"""How long an engine taken out may take to exit on SIGTERM before SIGKILL (a hung one never
does)."""

State = Literal["serving", "joining", "out", "restarting"]


class EngineDied(RuntimeError):
    """An inference engine of the run could not be kept (restart budget spent, or none left)."""


class EngineRefused(RuntimeError):
    """An engine that cannot serve this run (unidentified, or missing a capability it needs)."""


@dataclass
class Member:
    """One engine of the pool."""

    url: str
    launch: ServerLaunchConfig | None
    """How it was started; None: given by URL (never restarted from here, re-admitted)."""
    process: ServerProcess | None
    state: State = "serving"
    restarts: int = 0
    last_answer: float = field(default_factory=time.monotonic)
    out_since: float = 0.0
    retry_at: float = 0.0
    cause: str = ""
    probe: asyncio.Task | None = None
    """The progress probe under way (_probe_progress), if any."""
    wedged: str | None = None
    """Why the last probe found it making no progress: taken out at the next watch."""


class EngineSupervisor:
    """Starts (or adopts) the run's engines, keeps the pool (module docstring), stops the
    engines it started."""

    def __init__(
        self,
        settings: EngineSettings,
        processes: list[ServerProcess],
        launches: list[ServerLaunchConfig] | None = None,
        run_dir: Path | None = None,
        routed_experts: bool = False,
    ) -> None:
        self.settings, self.run_dir, self.routed_experts = settings, run_dir, routed_experts
        self.members: dict[str, Member] = {}
        for index, process in enumerate(processes):
            launch = launches[index] if launches else None
            self.members[process.url] = Member(process.url, launch, process)
        for url in settings.urls:
            self.members[url] = Member(url, None, None)
        self.epoch = 0
        self.events: Counter[str] = Counter()
        self.seconds_lost = 0.0
        self._client: RolloutClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._engines_file = EnginesFile(run_dir / ENGINES_FILE) if run_dir is not None else None
        self._probe_slots = asyncio.Semaphore(settings.file_probes)
        # Names are resolved on threads of their own: a host that never resolves must not hold
        # the default executor's threads, which the watch uses (process.stop, re-admission).
        self._resolver = ThreadPoolExecutor(settings.file_probes, "engines-file-resolve")
        self._probing: set[str] = set()
        self._resolved: dict[str, frozenset[tuple[str, int]]] = {}
        self._instances: dict[str, str] = {}
        self._empty_since: float | None = None
        self.kind: EngineKind = settings.kind
        """What the pool's engines are (the first one identified says, for engines by URL):
        one run speaks to engines of one wire (engine/wire.py)."""
        self._kind_known = bool(processes)

    @property
    def wire(self) -> EngineWire:
        return backend_for(self.kind).wire

    @property
    def urls(self) -> list[str]:
        """Every engine the pool has known, in order: started here, by URL, then from
        RUN_DIR/engines.txt."""
        return list(self.members)

    @property
    def processes(self) -> list[ServerProcess]:
        return [m.process for m in self.members.values() if m.process is not None]

    @classmethod
    def start(
        cls,
        settings: EngineSettings,
        model_path: Path,
        log_dir: Path,
        routed_experts: bool = False,
        run_dir: Path | None = None,
    ) -> EngineSupervisor:
        """Start settings.started engines of settings.kind serving model_path (returning
        routed experts when asked: MoE routing replay), adopt settings.urls, then check them
        all (module docstring); on any failure stop what was started and raise."""
        launches = launch_configs(settings, model_path, log_dir, routed_experts)
        started: list[ServerProcess] = []
        try:
            for launch in launches:
                started.append(launch_server(launch))
        except BaseException:
            for process in started:
                process.stop()
            raise
        supervisor = cls(settings, started, launches, run_dir, routed_experts)
        try:
            for process in supervisor.processes:
                process.wait_healthy(deadline_s=settings.start_timeout_s)
            for url in supervisor.urls:
                supervisor.check(url, routed_experts)
        except BaseException:
            supervisor.stop()
            raise
        return supervisor

    def check(self, url: str, routed_experts: bool, patience_s: float | None = None) -> ServerInfo:
        """What the engine at `url` is; EngineRefused if it cannot serve this run. An engine
        that does not answer yet is waited for up to `patience_s` (start_timeout_s)."""
        patience = self.settings.start_timeout_s if patience_s is None else patience_s
        try:
            info = identify(url, self.settings.unreachable_after_s, patience)
        except EngineRequestError as error:
            raise EngineRefused(f"inference engine refused: {error}") from None
        return self._fit(info, routed_experts)

    def _fit(self, info: ServerInfo, routed_experts: bool) -> ServerInfo:
        """`info`, its instance id remembered; EngineRefused if it cannot serve this run."""
        url = info.url
        if not self._kind_known:
            self.kind, self._kind_known = info.kind, True
        elif backend_for(info.kind).wire is not self.wire:
            raise EngineRefused(
                f"inference engine {url} refused: it is a {info.kind} server and the pool's "
                f"engines are {self.kind}; one run speaks to engines of one kind"
            )
        if routed_experts and not info.routed_experts:
            flag = "--enable-return-routed-experts"
            raise EngineRefused(
                f"inference engine {url} refused: learner.routing_replay needs the routed "
                f"experts of every position, and this {info.kind} server runs without them "
                f"(/server_info: enable_return_routed_experts is not true): start it with {flag}"
            )
        if info.instance is not None:
            self._instances[url] = info.instance
        return info

    # --- the pool, as the learner sees it ----------------------------------------------------

    def membership(self) -> tuple[int, list[str]]:
        """(epoch, the engines the next weight sync must reach: serving and joining)."""
        urls = [m.url for m in self.members.values() if m.state in ("serving", "joining")]
        return self.epoch, urls

    def joining(self) -> list[str]:
        """The engines waiting for a weight sync to serve (restarted, back, or new)."""
        return [m.url for m in self.members.values() if m.state == "joining"]

    async def synced(self, urls: list[str], version: str) -> None:
        """A weight sync to `urls` finished at `version`: each joining engine among them whose
        version read (the wire's version_path: SGLang's GET /model_info, vLLM's /weight_info)
        says so serves from now on."""
        for url in urls:
            member = self.members.get(url)
            if member is None or member.state != "joining":
                continue
            try:
                info = await asyncio.to_thread(get_json, url, self.wire.version_path, 10.0)
            except EngineRequestError as error:
                log.warning("engine %s did not confirm its weights (%s): it stays out", url, error)
                continue
            served = info.get("weight_version") if isinstance(info, dict) else info
            if str(served) != version:
                log.warning("engine %s serves version %r, not %s", url, served, version)
                continue
            member.state = "serving"
            lost = time.monotonic() - member.out_since if member.out_since else 0.0
            self.seconds_lost += lost
            member.out_since = 0.0
            if self._client is not None:
                self._client.admit(url)
            self._record(member.url, "in", f"serves version {version}", seconds_out=lost)

    async def take_out_unresponsive(self, urls: list[str], cause: str) -> None:
        """The weight sync found these engines not answering within its bound (a wedged
        scheduler still answers /model_info): out like a dead engine. A URL engine is looked
        at again after unreachable_after_s, not at the next watch, since it may answer the
        probe all along."""
        for url in urls:
            member = self.members.get(url)
            if member is None or member.state not in ("serving", "joining"):
                continue
            await self._take_out(member, cause)
            if member.launch is None:
                member.retry_at = time.monotonic() + self.settings.unreachable_after_s

    # --- the watch ---------------------------------------------------------------------------

    async def watch(self, client: RolloutClient | None = None) -> None:
        """Return never; keep the pool (module docstring); raise EngineDied when it cannot."""
        self._client = client
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.settings.unreachable_after_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._read_engines_file(session)
                for member in list(self.members.values()):
                    await self._check_member(session, member)
                self._check_not_empty()
                await asyncio.sleep(self.settings.watch_interval_s)

    async def _check_member(self, session: aiohttp.ClientSession, member: Member) -> None:
        now = time.monotonic()
        if member.state in ("serving", "joining"):
            code = member.process.proc.poll() if member.process is not None else None
            if code is not None:
                await self._take_out(member, f"exited with code {code}")
            elif failure := self._generation_failure(member, session):
                await self._take_out(member, failure)
                if member.launch is None:  # answering /model_info, it would be back at once
                    member.retry_at = now + self.settings.unreachable_after_s
            elif await _healthy(session, member.url, self.wire.version_path):
                member.last_answer = now
            elif now - member.last_answer > self.settings.unreachable_after_s:
                window = self.settings.unreachable_after_s
                await self._take_out(
                    member, f"has not answered GET {self.wire.version_path} for {window:g} s"
                )
        elif member.state == "out" and now >= member.retry_at:
            if member.launch is not None:
                self._restart(member)
            elif await _healthy(session, member.url, self.wire.version_path):
                await self._admit_url(member, "answers again")
            else:
                member.retry_at = now + self.settings.watch_interval_s

    def _generation_failure(self, member: Member, session: aiohttp.ClientSession) -> str | None:
        """Why a serving engine cannot generate, whether or not it answers GET /model_info:
        its requests failed failures_in_a_row times in a row, or it makes no progress (wedged:
        its requests have had no answer for stalled_after_s, timeouts included, and then a
        1-token probe had none either); None when neither. A stall alone only starts the probe
        (_probe_progress): slow is not wedged. Counted only while it serves: a joining
        engine's counts are those of its last life."""
        if self._client is None or member.state != "serving":
            return None
        failing = self._client.failing(member.url)
        if failing >= self.settings.failures_in_a_row:
            return f"failed {failing} generate requests in a row"
        if member.wedged is not None:
            cause, member.wedged = member.wedged, None
            return cause
        stalled = self._client.stalled_s(member.url)
        if stalled >= self.settings.stalled_after_s and member.probe is None:
            member.probe = self._spawn(self._probe_progress(session, member, stalled))
        return None

    async def _probe_progress(
        self, session: aiohttp.ClientSession, member: Member, stalled: float
    ) -> None:
        """Whether an engine whose requests had no answer for `stalled` seconds still
        generates: a 1-token generate request of its own, sent past the client's queue (the
        requests waiting for the engine's in-flight limit) and given stalled_after_s to answer.
        An answer restarts the engine's stall clock (an overloaded engine, or requests timing
        out below its service time: slow, not wedged); none sets `member.wedged` for the watch
        to act on. A scheduler stuck in a collective answers GET /model_info but never this."""
        bound = self.settings.stalled_after_s
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0)
        body = self.wire.generate_request([0], sampling, rid=f"progress-probe-{uuid.uuid4().hex}")
        started = time.monotonic()
        try:
            async with session.post(
                member.url + self.wire.generate_path,
                json=body,
                timeout=aiohttp.ClientTimeout(total=bound),
            ) as response:
                await response.read()
                answered = response.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            answered = False
        finally:
            member.probe = None
        if member.state != "serving" or self._client is None:
            return
        if answered:
            log.warning(
                "inference engine %s: slow, not wedged: no answer to its requests for %.1f s, "
                "and a 1-token probe answered in %.1f s",
                member.url,
                stalled,
                time.monotonic() - started,
            )
            self._client.progressed(member.url)
            return
        member.wedged = (
            f"wedged: its generate requests had no answer for {stalled:.1f} s, nor a 1-token "
            f"probe within {bound:g} s (rollout.engine.stalled_after_s={bound:g})"
        )

    async def _take_out(self, member: Member, cause: str) -> None:
        """Out of the pool now (its requests in flight go to the others); a started engine is
        stopped, and restarted later unless its budget is spent (then EngineDied). A restart
        that failed keeps the time the engine first went out, so the time lost counts it all."""
        now = time.monotonic()
        code = await _exit_code(member.process) if not cause.startswith("exited") else None
        if code is not None:  # what noticed first (a failed probe, a request) is the symptom
            cause = f"exited with code {code} ({cause})"
        member.state, member.cause = "out", cause
        member.out_since = member.out_since or now
        self.epoch += 1
        if self._client is not None and self._client.in_pool(member.url):
            self._client.take_out(member.url)
        self._record(member.url, "out", cause)
        process = member.process
        if process is None:
            member.retry_at = now + self.settings.watch_interval_s
            return
        tail = process.log_tail()
        await asyncio.to_thread(process.stop, STOP_TIMEOUT_S)
        if member.launch is None or member.restarts >= self.settings.restarts:
            budget = self.settings.restarts
            raise EngineDied(
                f"inference engine {member.url} (pid {process.pid}) {cause}; restarted "
                f"{member.restarts} time(s) of rollout.engine.restarts={budget}; last lines of "
                f"its log {process.log_path}:\n{tail}"
            )
        delay = self.settings.restart_backoff_s * 2**member.restarts
        member.retry_at = now + delay

    def _restart(self, member: Member) -> None:
        member.state = "restarting"
        member.restarts += 1
        self._spawn(self._relaunch(member))

    def _spawn(self, work: Coroutine[None, None, None]) -> asyncio.Task:
        """Run `work` beside the watch (cancelled by stop())."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _relaunch(self, member: Member) -> None:
        """Start the engine again on its port; it joins at the next sync once healthy. A start
        that fails counts against the budget like a death."""
        assert member.launch is not None
        try:
            member.process = await asyncio.to_thread(launch_server, member.launch)
            await asyncio.to_thread(member.process.wait_healthy, self.settings.start_timeout_s)
            await asyncio.to_thread(self.check, member.url, self.routed_experts, 0.0)
        except (ServerExited, TimeoutError, EngineRefused, EngineRequestError, OSError) as error:
            await self._take_out(member, f"failed to restart: {error}")
            return
        self._join(member, f"restarted (restart {member.restarts})")

    async def _admit_url(self, member: Member, event: str) -> None:
        try:
            await asyncio.to_thread(self.check, member.url, self.routed_experts, 0.0)
        except EngineRefused as error:
            member.retry_at = time.monotonic() + self.settings.unreachable_after_s
            self._record(member.url, "refused", str(error))
            return
        self._join(member, event)

    def _join(self, member: Member, event: str) -> None:
        member.state, member.last_answer = "joining", time.monotonic()
        self.epoch += 1
        self._record(member.url, "joining", event)

    def _read_engines_file(self, session: aiohttp.ClientSession) -> None:
        """When RUN_DIR/engines.txt changed: each line it leaves out is a "skipped" line of
        faults.jsonl, each URL new to the pool is probed beside the watch (_probe)."""
        listing = self._engines_file.changed() if self._engines_file is not None else None
        if listing is None:
            return
        for problem in listing.problems:
            self._record(ENGINES_FILE, "skipped", problem)
        for url in listing.urls:
            if url not in self.members and url not in self._probing:
                self._probing.add(url)
                self._spawn(self._probe(session, url))

    async def _probe(self, session: aiohttp.ClientSession, url: str) -> None:
        """A URL of the engines file joins the pool once it has answered /server_info, can
        serve the run and is no engine of the pool under another spelling (module docstring);
        otherwise a line of faults.jsonl says why."""
        try:
            async with self._probe_slots:
                same = await self._same_engine(url, session)
        except EngineRefused as error:
            self._record(url, "refused", str(error))
            return
        finally:
            self._probing.discard(url)
        if same is not None:
            self._record(url, "skipped", f"{ENGINES_FILE}: {url} is {same}; left out")
            return
        member = self.members[url] = Member(url, None, None, state="out")
        self._join(member, f"listed in {ENGINES_FILE}")

    async def _same_engine(self, url: str, session: aiohttp.ClientSession) -> str | None:
        """Which engine of the pool `url` is (words for the record), None when it is new;
        EngineRefused when it does not resolve, answer or fit. Nothing is awaited between the
        last comparison and the caller's admission, so two spellings of one new engine probed
        at once do not both join."""
        where = await self._resolve(url)
        if not where:
            raise EngineRefused(f"inference engine {url} refused: its host does not resolve")
        for member in list(self.members.values()):
            await self._resolve(member.url)
        same = self._compare(where, None)
        if same is None:
            info = await self._identify(session, url)
            same = self._compare(where, info.instance)
        return same

    def _compare(self, where: frozenset[tuple[str, int]], instance: str | None) -> str | None:
        for member in self.members.values():
            if where & self._resolved.get(member.url, frozenset()):
                return f"at the address of {member.url}, already in the pool"
            if instance is not None and self._instances.get(member.url) == instance:
                return f"{member.url} of the pool (the same /server_info instance_id)"
        return None

    async def _resolve(self, url: str) -> frozenset[tuple[str, int]]:
        """The (address, port) pairs `url` reaches, this host's own addresses as one name;
        empty when its host does not resolve within unreachable_after_s (not remembered)."""
        if url in self._resolved:
            return self._resolved[url]
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        lookup = functools.partial(
            socket.getaddrinfo, parts.hostname, port, type=socket.SOCK_STREAM
        )
        try:
            found = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._resolver, lookup),
                self.settings.unreachable_after_s,
            )
        except (OSError, TimeoutError):
            return frozenset()
        where = frozenset((_this_host(str(entry[4][0])), port) for entry in found)
        self._resolved[url] = where
        return where

    async def _identify(self, session: aiohttp.ClientSession, url: str) -> ServerInfo:
        """/server_info of `url`, read and fitted to the run, within unreachable_after_s
        (without a thread: a flood of mute URLs holds none of the pool's)."""
        window = self.settings.unreachable_after_s
        try:
            async with session.get(
                url + (SERVER_INFO_PATH + INFO_QUERY), timeout=aiohttp.ClientTimeout(total=window)
            ) as response:
                if response.status >= 300:
                    raise EngineRequestError(f"HTTP {response.status}", response.status)
                body = await response.json(content_type=None)
            info = parse_server_info(url, body)
        except TimeoutError:
            raise EngineRefused(
                f"inference engine {url} refused: no answer on GET {SERVER_INFO_PATH} within "
                f"{window:g} s (rollout.engine.unreachable_after_s)"
            ) from None
        except (aiohttp.ClientError, OSError, ValueError, EngineRequestError) as error:
            raise EngineRefused(
                f"inference engine {url} refused: GET {SERVER_INFO_PATH}: {error}"
            ) from None
        return self._fit(info, self.routed_experts)

    def _check_not_empty(self) -> None:
        alive = [m for m in self.members.values() if m.state != "out"]
        now = time.monotonic()
        if alive:
            self._empty_since = None
            return
        self._empty_since = self._empty_since or now
        if now - self._empty_since > self.settings.start_timeout_s:
            causes = "; ".join(f"{m.url} {m.cause}" for m in self.members.values())
            raise EngineDied(
                f"no inference engine has been in the pool for "
                f"{self.settings.start_timeout_s:g} s (rollout.engine.start_timeout_s): {causes}"
            )

    def _record(self, engine: str, event: str, cause: str, **figures: float) -> None:
        """One event of the pool: logged, counted, a line of RUN_DIR/faults.jsonl (an "in"
        line carries seconds_out, the time the engine was out of the pool, if it was)."""
        self.events[event] += 1
        log.warning("inference engine %s: %s (%s)", engine, event, cause)
        if self.run_dir is not None:
            line = {"time": time.time(), "engine": engine, "event": event, "cause": cause}
            line |= figures
            with open(self.run_dir / FAULTS_FILE, "a") as faults:
                faults.write(json.dumps(line) + "\n")

    def stats(self) -> dict[str, float]:
        """The pool's counters for metrics.jsonl."""
        now = time.monotonic()
        out = [m for m in self.members.values() if m.state != "serving" and m.out_since]
        return {
            "engines_serving": sum(m.state == "serving" for m in self.members.values()),
            "engines_out_total": self.events["out"],
            "engines_restarted_total": sum(m.restarts for m in self.members.values()),
            "engines_back_in_total": self.events["in"],
            "engine_seconds_lost": self.seconds_lost + sum(now - m.out_since for m in out),
        }

    def stop(self) -> None:
        """Stop the engines this supervisor started (by their own process groups)."""
        for task in self._tasks:
            task.cancel()
        self._resolver.shutdown(wait=False, cancel_futures=True)
        for process in self.processes:
            process.stop()


def launch_configs(
    settings: EngineSettings, model_path: Path, log_dir: Path, routed_experts: bool
) -> list[ServerLaunchConfig]:
    """One launch config per engine the run starts: consecutive ports from settings.port (free
    ones when 0), and for SGLang tp_size GPUs each (settings.gpu_ids in blocks, or the
    blocks after the learner's: engine/launcher.py)."""
    configs = []
    size = settings.tp_size
    for index in range(settings.started):
        port = settings.port + index if settings.port else free_port()
        gpus = settings.gpu_ids[index * size : (index + 1) * size]
        configs.append(
            ServerLaunchConfig(
                model_path=str(model_path),
                port=port,
                log_dir=log_dir,
                engine=settings.kind,
                python=settings.python,
                extra_args=settings.extra_args,
                cpu_threads=settings.threads,
                tp_size=size,
                gpu_ids=gpus,
                replica=index,
                return_routed_experts=routed_experts,
            )
        )
    return configs


def _this_host(address: str) -> str:
    """`address`, or "this host" for a loopback or unspecified one (0.0.0.0 reaches here)."""
    parsed = ipaddress.ip_address(address.split("%")[0])
    return "this host" if parsed.is_loopback or parsed.is_unspecified else str(parsed)


EXIT_GRACE_S = 1.0
"""How long an engine taken out for a symptom is given to show that it is exiting: a killed
engine's connections close while the kernel is still tearing the process down, so the probe
or request that failed on it can be seen before the exit is."""


async def _exit_code(process: ServerProcess | None) -> int | None:
    """The engine process's exit code if it has exited or does within EXIT_GRACE_S, else None
    (also for an engine given by URL)."""
    if process is None:
        return None
    try:
        return await asyncio.to_thread(process.proc.wait, EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        return None


async def _healthy(session: aiohttp.ClientSession, url: str, path: str) -> bool:
    """Whether `url` answers GET `path` (the wire's version_path: it runs no generation)."""
    try:
        async with session.get(url + path) as response:
            return response.status < 300
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
