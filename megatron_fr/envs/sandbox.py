"""Runs model-written Python in a sandbox process and reports what happened, never hanging.

    Sandbox(config).run(code)
      ─► wait for one of max_concurrent_runs slots
      ─► a fresh cgroup for the call, limited to memory_bytes (sandbox_memory.py), if any
      ─► Popen(base interpreter -I sandbox_boot.py, own session; stdin: an anonymous file
         holding the code, so no byte of it can break the launch); the supervisor joins the
         cgroup before it starts anything
      ─► read stdout + stderr with a byte cap, until EOF, exit, or the wall-clock deadline
      ─► always: SIGUSR1 to the supervisor, which kills and reaps the whole tree and exits;
         then SIGKILL whatever is left in the process group or (as root) of the run's uid,
         until none is left (checked in /proc); reap; remove the private directory and cgroup
      ─► SandboxResult(status "ok" | "error" | "timeout" | "output_limit" | "cpu_limit" |
         "memory_limit" | "signal", exit code, output, isolation, memory_limit, peak, ...)

What each layer guarantees (SANDBOX.md has the table; measured on the project's CPU machine:
root in a container, Linux 6.x, with CAP_SYS_ADMIN, cgroup v1 memory controller;
tests/unit/test_sandbox_*.py exercise each one alone):

- network namespace ("namespaces" mode): the code has only a loopback interface that is down,
  so no connection leaves it, not even to 127.0.0.1 services of the host (an OS guarantee).
- mount namespace + chroot into a tmpfs: the code sees /usr, /lib*, /bin, /sbin, the
  interpreter's prefix (read-only, nosuid) and /etc/ld.so.cache, a fresh /proc, four /dev
  nodes, and its private /sandbox and /tmp on a size-limited tmpfs that vanishes with it; the
  repository, the home directory, /etc and everything else do not exist for it.
- pid namespace: when the code's main process ends, or the parent kills the supervisor, the
  kernel kills every process the code started (setsid or double fork do not escape).
- its own uid (a fresh one per run, when started as root) and no groups, no_new_privs: files
  of other users are protected by permissions, and RLIMIT_NPROC counts only this run's
  processes (root ignores RLIMIT_NPROC, which is why the uid matters for the fork bomb bound).
- the call's cgroup: memory_bytes for all of the call's processes together (heap, tmpfs
  files, page cache); past it the kernel OOM-kills inside the call only ("memory_limit").
  Without a cgroup: RLIMIT_AS of (memory_bytes - disk_bytes) / max_processes per process,
  which bounds the sum as long as the process count is bounded (weaker, logged as a warning).
- rlimits: address space (a 10 GB allocation fails with MemoryError), CPU seconds (SIGXCPU,
  then SIGKILL), processes, file size, open files, no core dumps.
- the parent: wall-clock deadline, output byte cap (reading stops and the run is killed), the
  uid sweep, the check that nothing of the run is left, and max_concurrent_runs (so that
  max_concurrent_runs x memory_bytes, checked against half the node, is all calls can take).
- the audit hook (sandbox_runner.py): refuses sockets, starting programs, ctypes, gc
  introspection and files outside the allowed directories from Python; a convenience for clear
  errors, not a boundary (it lives in the process it watches: a symlink swapped after its
  check, or a C-level path, goes round it). No property above relies on it.

"rlimits" mode is the fallback where namespaces cannot be created (not root, no
CAP_SYS_ADMIN): rlimits, the uid (only as root), the parent's limits and the audit hook; the
code then shares the host's network and filesystem view, and only the audit hook keeps it from
them, so this mode is not safe against hostile code: it is logged as a warning and listed in
`Sandbox.weaknesses` (python_tool puts them in each tool step's info). "auto" probes once per
Sandbox.

The code runs on the base interpreter of this Python (no virtualenv, no PYTHONPATH), so it has
the standard library and nothing of the project's environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import PositiveFloat, PositiveInt

from megatron_fr.config.base import StrictModel
from megatron_fr.envs.sandbox_memory import (
    CallCgroup,
    MemoryBound,
    MemoryLimit,
    node_memory_bytes,
)
from megatron_fr.envs.sandbox_procs import exited, group_members, processes_of, tasks_of

log = logging.getLogger("megatron_fr.sandbox")

BOOT = Path(__file__).with_name("sandbox_boot.py")
RUNNER = Path(__file__).with_name("sandbox_runner.py")
UID_RANGE = (0x4000_0000, 0x4100_0000)
"""Sandbox uids are drawn from here: far above any real account."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
READ_CHUNK = 65536
STOP_GRACE_S = 5.0

Isolation = Literal["namespaces", "rlimits"]
Status = Literal["ok", "error", "timeout", "output_limit", "cpu_limit", "memory_limit", "signal"]
NODE_SHARE = 0.5
"""At most this share of the node's memory may be promised to sandbox calls at once
(max_concurrent_runs x memory_bytes): the trainer and the inference server need the rest."""
WEAKER_ISOLATION = (
    "rlimits isolation: the code shares the host's network and filesystem view; only the "
    "audit hook (a tripwire, not a boundary) refuses them"
)
WEAKER_MEMORY = "rlimits memory bound: RLIMIT_AS shares of memory_bytes per process, not a cgroup"


class SandboxConfig(StrictModel):
    """Limits of one sandboxed run (SANDBOX.md: which layer enforces which)."""

    wall_timeout_s: PositiveFloat = 10.0
    """Wall-clock limit of the whole run (startup included: about 0.1 s; waiting for a free
    slot, max_concurrent_runs, is not)."""
    cpu_time_s: PositiveInt = 5
    """CPU seconds per process (RLIMIT_CPU): SIGXCPU, then SIGKILL one second later."""
    memory_bytes: PositiveInt = 2**30
    """Memory of one call, all of its processes together: a cgroup's limit, or without one
    RLIMIT_AS of (memory_bytes - disk_bytes) / max_processes per process (sandbox_memory.py)."""
    memory_limit: Literal["auto", "cgroup", "rlimits"] = "auto"
    """How memory_bytes is enforced. auto: a cgroup (v2, else v1) where one can be made, else
    the RLIMIT_AS shares (logged as a warning); cgroup: fail when none can be made."""
    cgroup_parent: str | None = None
    """A cgroup directory to make each call's cgroup in (v2: its cgroup.subtree_control gets
    memory; it must hold no process). None: this process's own cgroup, where usable."""
    max_concurrent_runs: PositiveInt = 4
    """Calls of one Sandbox running at once; more wait for a free slot. What the sandbox can
    take from the node is max_concurrent_runs x memory_bytes, which must fit in half of it
    (the default, 4 GiB, fits a 16 GB machine; a training node can afford far more)."""
    max_processes: PositiveInt = 16
    """Processes and threads of the run at once (RLIMIT_NPROC on the run's own uid)."""
    max_output_bytes: PositiveInt = 16 * 2**10
    """stdout + stderr kept; one byte more and the run is killed as "output_limit"."""
    max_file_bytes: PositiveInt = 8 * 2**20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    disk_bytes: PositiveInt = 32 * 2**20
    """Size of the private tmpfs holding /sandbox and /tmp ("namespaces" mode)."""
    max_open_files: PositiveInt = 64
    max_code_bytes: PositiveInt = 100_000
    """Longest code accepted (UTF-8 bytes). It reaches the interpreter through an anonymous
    file as its stdin, never argv or the environment, so no byte of it (NUL...) breaks the
    launch."""
    isolation: Literal["auto", "namespaces", "rlimits"] = "auto"
    """auto: "namespaces" where they can be created, else "rlimits" (module docstring)."""
    audit_hook: bool = True
    """Also install the Python audit hook (clear PermissionErrors; defence in depth)."""
    interpreter: str | None = None
    """The Python that runs the code (None: this Python's base interpreter, outside any
    virtualenv). In "rlimits" mode as root the sandbox uid must be able to run it, which an
    interpreter under /root (pyenv) is not: name a system one (/usr/bin/python3) there."""


@dataclass(frozen=True)
class SandboxResult:
    """What one run did. `tool_error` is what an agent sees as a failed tool call."""

    status: Status
    exit_code: int | None
    """The code's exit status (128 + signal when a signal ended it); None when we killed it."""
    stdout: str
    stderr: str
    elapsed_s: float
    isolation: Isolation
    memory_limit: MemoryLimit
    """How memory_bytes held the call: "cgroup2", "cgroup1" or "rlimits" (weaker)."""
    memory_peak_bytes: int | None
    """The most memory the call's processes held at once, from its cgroup (None without)."""
    uid: int
    """The uid the code ran as (fresh per run as root): nothing of it is left when run returns."""
    pgid: int
    """The run's process group (the supervisor's pid)."""

    @property
    def tool_error(self) -> bool:
        return self.status != "ok"

    def describe(self, limits: SandboxConfig) -> str:
        """One line for an observation: why the run failed, or "ok"."""
        return {
            "ok": "ok",
            "error": f"exit code {self.exit_code}",
            "timeout": f"timed out after {limits.wall_timeout_s:g} s (killed)",
            "output_limit": f"output exceeded {limits.max_output_bytes} bytes (killed)",
            "cpu_limit": f"CPU time limit of {limits.cpu_time_s} s exceeded (killed)",
            "memory_limit": f"memory limit of {limits.memory_bytes} bytes for all processes "
            "together exceeded (killed)",
            "signal": f"killed by signal {(self.exit_code or 128) - 128}",
        }[self.status]


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not be built, or a process survived): not the code's
    fault, so it is raised rather than returned as a result (python_tool logs it and still
    answers the policy with a tool error)."""


def _interpreter(path: str | None) -> tuple[str, list[str]]:
    """The interpreter (default: this one's base, outside any virtualenv) and the directories
    it needs (its prefixes)."""
    if path is None:
        python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
        prefixes = [sys.base_prefix, sys.base_exec_prefix]
    else:
        python = os.path.realpath(path)
        asked = "import sys, json; print(json.dumps([sys.base_prefix, sys.base_exec_prefix]))"
        done = subprocess.run(
            [python, "-I", "-c", asked], capture_output=True, text=True, timeout=30, check=True
        )
        prefixes = json.loads(done.stdout)
    return python, sorted({os.path.realpath(prefix) for prefix in prefixes})


class Sandbox:
    """Runs code under `config`; thread-safe, one process tree per run, at most
    max_concurrent_runs at once."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = cfg = config or SandboxConfig()
        promised, node = cfg.max_concurrent_runs * cfg.memory_bytes, node_memory_bytes()
        if promised > NODE_SHARE * node:
            raise ValueError(
                f"sandbox max_concurrent_runs x memory_bytes = {promised} bytes is more than "
                f"{NODE_SHARE:g} of this node's {node} bytes: lower one of them"
            )
        self._python, self._python_dirs = _interpreter(cfg.interpreter)
        self._memory = MemoryBound.detect(cfg.memory_bytes, cfg.memory_limit, cfg.cgroup_parent)
        self._memory.rlimit_as(cfg.max_processes, cfg.disk_bytes)  # a share too small: fail now
        self._isolation: Isolation | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent_runs)

    @property
    def isolation(self) -> Isolation:
        """The mode runs use; "auto" is resolved by one probe run, the first time it is asked."""
        with self._lock:
            if self._isolation is None:
                self._isolation = self._resolve()
                if self._isolation == "rlimits":
                    log.warning("sandbox is WEAKER than its namespaced form: %s", WEAKER_ISOLATION)
            return self._isolation

    @property
    def memory_limit(self) -> MemoryLimit:
        return self._memory.kind

    @property
    def weaknesses(self) -> list[str]:
        """How this sandbox falls short of namespaces + a cgroup (empty: it does not). Each
        was logged as a WARNING when found; python_tool reports them in its step info."""
        weaker = [WEAKER_ISOLATION] if self.isolation == "rlimits" else []
        return weaker + ([WEAKER_MEMORY] if self.memory_limit == "rlimits" else [])

    def _resolve(self) -> Isolation:
        if self.config.isolation != "auto":
            return self.config.isolation
        if os.geteuid() == 0:
            try:
                self._run(b"pass", "namespaces")
                return "namespaces"
            except SandboxError as error:
                log.warning("sandbox namespaces unavailable (%s); trying rlimits only", error)
        # As root this needs an interpreter that the sandbox uid may run (not one under /root).
        self._run(b"pass", "rlimits")
        return "rlimits"

    def run(self, code: str) -> SandboxResult:
        """Run `code` to completion or to a limit. Raises SandboxError (infrastructure failure),
        ValueError (code longer than max_code_bytes); everything the code does is a result.
        Lone surrogates travel as they are, for the interpreter to reject as the code's error."""
        payload = code.encode("utf-8", "surrogatepass")
        if len(payload) > self.config.max_code_bytes:
            raise ValueError(f"code is longer than {self.config.max_code_bytes} bytes")
        isolation = self.isolation
        with self._slots:
            return self._run(payload, isolation)

    def _run(self, payload: bytes, isolation: Isolation) -> SandboxResult:
        uid = self._fresh_uid()
        root = tempfile.mkdtemp(prefix="mfr-sandbox-")
        report_read, report_write = os.pipe()
        try:
            if isolation == "rlimits" and os.geteuid() == 0:
                os.chown(root, uid, uid)
            with self._memory.call() as cgroup:
                boot_config = self._boot_config(isolation, uid, root) | {
                    "report_fd": report_write,
                    "cgroup_procs": cgroup.procs_file if cgroup else None,
                }
                proc = self._start(boot_config, payload, root, report_write)
                os.close(report_write)
                report_write = -1
                result = self._supervise(proc, isolation, uid, cgroup, time.monotonic())
            failure = _read_report(report_read)
        except OSError as error:  # no cgroup, no process...: the machine's fault, not the code's
            raise SandboxError(f"{isolation} sandbox could not be started: {error}") from error
        finally:
            for fd in (report_read, report_write):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(root, ignore_errors=True)
        if failure:
            raise SandboxError(f"{isolation} sandbox could not be built: {failure}")
        return result

    def _start(
        self, boot_config: dict[str, object], payload: bytes, root: str, report_fd: int
    ) -> subprocess.Popen:
        """The supervisor, with the code in an anonymous file as its stdin; it inherits
        `report_fd` (the report pipe's write end, boot_config's report_fd)."""
        code_file = _code_file(payload)
        try:
            return subprocess.Popen(
                [self._python, "-I", str(BOOT), json.dumps(boot_config)],
                stdin=code_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=root,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
                pass_fds=(report_fd,),
            )
        finally:
            os.close(code_file)

    def _fresh_uid(self) -> int:
        if os.geteuid() != 0:
            return os.getuid()
        while True:
            uid = random.randrange(*UID_RANGE)
            if not processes_of(uid):
                return uid

    def _process_memory(self, isolation: Isolation) -> int:
        """RLIMIT_AS of each process of a run in `isolation` (MemoryBound.rlimit_as)."""
        tmpfs = self.config.disk_bytes if isolation == "namespaces" else 0
        return self._memory.rlimit_as(self.config.max_processes, tmpfs)

    def _boot_config(self, isolation: Isolation, uid: int, root: str) -> dict[str, object]:
        cfg = self.config
        inside = isolation == "namespaces"
        workdir, tmpdir = ("/sandbox", "/tmp") if inside else (root, root)
        max_processes: int | None = cfg.max_processes
        if os.geteuid() != 0:  # our own uid: the limit must leave room for what already runs
            max_processes = tasks_of(uid) + cfg.max_processes
        return {
            "isolation": isolation,
            "parent_pid": os.getpid(),
            "uid": uid,
            "root_dir": root,
            "workdir": workdir,
            "tmpdir": tmpdir,
            "python": self._python,
            "python_dirs": self._python_dirs,
            "runner_path": str(RUNNER),
            "disk_bytes": cfg.disk_bytes,
            "cpu_time_s": cfg.cpu_time_s,
            "memory_bytes": self._process_memory(isolation),
            "max_processes": max_processes,
            "max_file_bytes": cfg.max_file_bytes,
            "max_open_files": cfg.max_open_files,
            "hook": {
                "enabled": cfg.audit_hook,
                "read_roots": [*self._python_dirs, *DEVICES],
                "write_roots": [workdir, tmpdir, "/dev/null"],
            },
        }

    def _supervise(
        self,
        proc: subprocess.Popen,
        isolation: Isolation,
        uid: int,
        cgroup: CallCgroup | None,
        start: float,
    ) -> SandboxResult:
        if proc.stdout is None or proc.stderr is None:  # _start opens both as pipes
            raise SandboxError("the supervisor's stdout and stderr are not pipes")
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        streams = {out_fd: bytearray(), err_fd: bytearray()}
        status = self._read(proc, streams, start + self.config.wall_timeout_s)
        self._stop(proc, uid)
        self._drain(streams)
        exit_code = proc.wait()
        elapsed = time.monotonic() - start
        proc.stdout.close()
        proc.stderr.close()
        stdout, stderr = bytes(streams[out_fd]), bytes(streams[err_fd])
        if status is None:
            status = _status_of(exit_code)
        if cgroup is not None and cgroup.oom_kills():  # the kernel killed a process for memory
            status = "memory_limit"
        cap = self.config.max_output_bytes
        return SandboxResult(
            status=status,
            exit_code=None if status in ("timeout", "output_limit") else exit_code,
            stdout=stdout[:cap].decode(errors="replace"),
            stderr=stderr[:cap].decode(errors="replace"),
            elapsed_s=elapsed,
            isolation=isolation,
            memory_limit=self._memory.kind,
            memory_peak_bytes=cgroup.peak_bytes() if cgroup else None,
            uid=uid,
            pgid=proc.pid,
        )

    def _read(
        self, proc: subprocess.Popen, streams: dict[int, bytearray], deadline: float
    ) -> Status | None:
        """Collect output until both pipes close or the supervisor exits; "timeout" or
        "output_limit" when a limit ended the run first."""
        selector = selectors.DefaultSelector()
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                for key, _ in selector.select(timeout=min(remaining, 0.05)):
                    data = os.read(key.fd, READ_CHUNK)
                    if not data:
                        selector.unregister(key.fd)
                    streams[key.fd] += data
                    if sum(map(len, streams.values())) > self.config.max_output_bytes:
                        return "output_limit"
                if exited(proc.pid):
                    return None  # leftovers holding the pipes are killed next
            return None
        finally:
            selector.close()

    def _stop(self, proc: subprocess.Popen, uid: int) -> None:
        """End the run: SIGUSR1 asks the supervisor to kill and reap its whole tree and exit;
        then SIGKILL what is left of the process group and, as root, of the run's uid (the
        uid is this run's alone), until none is left. All of it happens before the supervisor
        is reaped, so its pid (the group id) cannot have been reused meanwhile."""
        pgid = proc.pid
        if not exited(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pgid, signal.SIGUSR1)
        deadline = time.monotonic() + STOP_GRACE_S
        while not exited(pgid) and time.monotonic() < deadline:
            time.sleep(0.002)
        if not exited(pgid):  # last resort: it did not exit on request
            log.warning("sandbox supervisor %d ignored SIGUSR1; killing its group", pgid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        sweep_uid = os.geteuid() == 0
        deadline = time.monotonic() + STOP_GRACE_S
        while True:
            survivors = [pid for pid in group_members(pgid) if pid != pgid]
            survivors += processes_of(uid) if sweep_uid else []
            if not survivors:
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"sandbox processes {survivors} survived SIGKILL")
            for pid in survivors:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)

    def _drain(self, streams: dict[int, bytearray]) -> None:
        """Read what the killed processes left in the pipes (every writer is gone: EOF comes)."""
        cap = self.config.max_output_bytes
        for fd, buffer in streams.items():
            os.set_blocking(fd, False)
            with contextlib.suppress(BlockingIOError):
                while len(buffer) <= cap and (data := os.read(fd, READ_CHUNK)):
                    buffer += data


def _code_file(payload: bytes) -> int:
    """An anonymous in-memory file holding the code, rewound: the sandbox's stdin. A file, not
    a pipe, so the parent never blocks on a large program and any byte is just data."""
    fd = os.memfd_create("sandbox-code")
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_report(fd: int) -> str:
    """What the sandbox wrote on its report pipe: nothing unless it could not be built (every
    writer is gone by now, so this does not block)."""
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _status_of(exit_code: int) -> Status:
    if exit_code == 0:
        return "ok"
    if exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu_limit"
    if exit_code < 0 or exit_code > 128:
        return "signal"
    return "error"
