"""The inference engines of a run, supervised: a dead engine ends the run within seconds.

The run's engines are one pool: rollout.engine.count started here (consecutive ports, and for
SGLang consecutive blocks of GPUs) and any given by URL; the rollout client spreads requests
over all of them and every weight sync reaches all of them.

Before any step every engine (started here or given by URL) says what it is on GET
/server_info (engine/server_info.py); one that does not, or that cannot give the routed
experts a routing-replay run needs (SGLang without --enable-return-routed-experts), is
refused with the reason (EngineRefused) instead of failing the first rollout.

Engines the run started are watched by their process (exit code and the tail of their log
name the cause); engines given by URL are probed on GET /model_info, and one that has not
answered for `unreachable_after_s` counts as dead too. Not /health: SGLang 0.5.23 runs a
generation there unless started with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, which waits
while a weight sync pauses the server and answers 503 after 20 s, so a sync longer than the
window would be taken for a death; /model_info is answered without generating.

Why end the run rather than continue on the others: every engine is a member of the
weight-update process group (NCCL on GPUs), and a group with a dead member cannot broadcast
again until it is rebuilt on every engine and every sending rank; a restart from the last
checkpoint with the same command does exactly that (weights/sync.py: connect clears what the
dead learner left on long-lived engines), and resumes without losing or repeating a prompt.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.engine.http import MODEL_INFO_PATH, EngineRequestError
from megatron_fr.engine.launcher import ServerLaunchConfig, ServerProcess, launch_server
from megatron_fr.engine.server_info import ServerInfo, identify
from megatron_fr.parallel.spawn import free_port


class EngineDied(RuntimeError):
    """An inference engine of the run exited or stopped answering."""


class EngineRefused(RuntimeError):
    """An engine that cannot serve this run (unidentified, or missing a capability it needs)."""


class EngineSupervisor:
    """Starts (or adopts) the run's engines, watches them, stops the ones it started."""

    def __init__(self, settings: EngineSettings, processes: list[ServerProcess]) -> None:
        self.settings = settings
        self.processes = processes

    @property
    def urls(self) -> list[str]:
        """The pool: the engines started here, then those given by URL."""
        return [process.url for process in self.processes] + list(self.settings.urls)

    @classmethod
    def start(
        cls, settings: EngineSettings, model_path: Path, log_dir: Path, routed_experts: bool = False
    ) -> EngineSupervisor:
        """Start settings.started engines of settings.kind serving model_path (returning
        routed experts when asked: MoE routing replay), adopt settings.urls, then check them
        all (module docstring); on any failure stop what was started and raise."""
        supervisor = cls(settings, [])
        try:
            for launch in launch_configs(settings, model_path, log_dir, routed_experts):
                supervisor.processes.append(launch_server(launch))
            for process in supervisor.processes:
                process.wait_healthy(deadline_s=settings.start_timeout_s)
            for url in supervisor.urls:
                supervisor.check(url, routed_experts)
        except BaseException:
            supervisor.stop()
            raise
        return supervisor

    def check(self, url: str, routed_experts: bool) -> ServerInfo:
        """What the engine at `url` is; EngineRefused if it cannot serve this run. An engine
        given by URL that does not answer yet is waited for up to start_timeout_s."""
        try:
            info = identify(url, self.settings.unreachable_after_s, self.settings.start_timeout_s)
        except EngineRequestError as error:
            raise EngineRefused(f"inference engine refused: {error}") from None
        if routed_experts and not info.routed_experts:
            flag = "--enable-return-routed-experts"
            raise EngineRefused(
                f"inference engine {url} refused: learner.routing_replay needs the routed "
                f"experts of every position, and this {info.kind} server runs without them "
                f"(/server_info: enable_return_routed_experts is not true): start it with {flag}"
            )
        return info

    async def watch(self) -> None:
        """Return never; raise EngineDied naming the engine once one is dead."""
        last_answer = {url: time.monotonic() for url in self.urls}
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.settings.unreachable_after_s))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                for process in self.processes:
                    self._check_process(process)
                for url in self.settings.urls:
                    if await _healthy(session, url):
                        last_answer[url] = time.monotonic()
                    elif time.monotonic() - last_answer[url] > self.settings.unreachable_after_s:
                        raise EngineDied(
                            f"inference engine {url} has not answered GET {MODEL_INFO_PATH} for "
                            f"{self.settings.unreachable_after_s:g} s"
                        )
                await asyncio.sleep(self.settings.watch_interval_s)

    @staticmethod
    def _check_process(process: ServerProcess) -> None:
        code = process.proc.poll()
        if code is not None:
            raise EngineDied(
                f"inference engine {process.url} (pid {process.pid}) exited with code {code}; "
                f"last lines of its log {process.log_path}:\n{process.log_tail()}"
            )

    def stop(self) -> None:
        """Stop the engines this supervisor started (by their own process groups)."""
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
                cpu_threads=settings.threads,
                tp_size=size,
                gpu_ids=gpus,
                replica=index,
                return_routed_experts=routed_experts,
            )
        )
    return configs


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + MODEL_INFO_PATH) as response:
            return response.status < 300
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
