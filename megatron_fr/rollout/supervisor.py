"""The inference engines of a run, supervised: a dead engine ends the run within seconds.

Engines the run started are watched by their process (exit code and the tail of their log
name the cause); engines given by URL are probed on GET /health, and one that has not answered
for `unreachable_after_s` counts as dead too. Why end the run rather than continue on the
others: every engine is a member of the weight-update process group (NCCL on GPUs), and a
group with a dead member cannot broadcast again until it is rebuilt on every engine and every
sending rank; a restart from the last checkpoint with the same command does exactly that, and
resumes without losing or repeating a prompt.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from megatron_fr.config.rollout import EngineSettings
from megatron_fr.engine.launcher import ServerLaunchConfig, ServerProcess, launch_server
from megatron_fr.engine.protocol import HEALTH_PATH


class EngineDied(RuntimeError):
    """An inference engine of the run exited or stopped answering."""


class EngineSupervisor:
    """Starts (or adopts) the run's engines, watches them, stops the ones it started."""

    def __init__(self, settings: EngineSettings, processes: list[ServerProcess]) -> None:
        self.settings = settings
        self.processes = processes
        self.urls = [p.url for p in processes] or list(settings.urls)

    @classmethod
    def start(cls, settings: EngineSettings, model_path: Path, log_dir: Path, port: int,
              routed_experts: bool = False):  # fmt: skip
        """Adopt settings.urls, or start one engine serving model_path on `port` (returning
        routed experts when asked: MoE routing replay)."""
        if settings.urls:
            return cls(settings, [])
        launch = ServerLaunchConfig(
            model_path=str(model_path), port=port, log_dir=log_dir, cpu_threads=settings.threads,
            tp_size=settings.tp_size, gpu_ids=settings.gpu_ids,
            return_routed_experts=routed_experts,
        )  # fmt: skip
        process = launch_server(launch)
        supervisor = cls(settings, [process])
        try:
            process.wait_healthy(deadline_s=settings.start_timeout_s)
        except BaseException:
            supervisor.stop()
            raise
        return supervisor

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
                            f"inference engine {url} has not answered GET {HEALTH_PATH} for "
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


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + HEALTH_PATH) as response:
            return response.status < 300
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
