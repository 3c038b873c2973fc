"""The memory bound of one sandbox call: every process of the call together, not each one.

    bound = MemoryBound.detect(memory_bytes, "auto", cgroup_parent=None)  # once per Sandbox
    with bound.call() as cgroup:            # a fresh cgroup per call (None: rlimits bound)
        boot config: {"cgroup_procs": cgroup.procs_file, "memory_bytes": bound.rlimit_as(...)}
        ... the call runs ...
        cgroup.peak_bytes(), cgroup.oom_kills()

Three ways, best first (the first that works on this machine is used, and logged):

- "cgroup2": a child of a cgroup v2 directory whose subtree has the memory controller (the
  `cgroup_parent` option, or this process's own cgroup when its cgroup.subtree_control already
  lists memory): memory.max = the bound, memory.swap.max = 0, memory.oom.group = 1.
- "cgroup1": a child of this process's cgroup in the v1 memory hierarchy (hybrid layouts, most
  containers on cgroup v1): memory.limit_in_bytes = memory.memsw.limit_in_bytes = the bound.
- "rlimits": no cgroup can be made. RLIMIT_AS of each process = (bound - the private tmpfs) /
  max_processes, so address space (an upper bound of resident memory) summed over the most
  processes the call may have stays under the bound. Weaker: a process gets a small share even
  when it runs alone, and memory the kernel holds for the call (pipes, page tables) is outside.

With a cgroup the kernel charges every page the call's processes fault (heap, tmpfs files,
page cache) to it; past the bound it reclaims, then OOM-kills inside the cgroup only, never the
trainer. The supervisor joins the cgroup before it starts anything, so no process of the call
is outside it. Cgroups are used only as root: the code then runs as another uid and cannot
write the cgroup's files (as our own uid it could raise its own limit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("megatron_fr.sandbox")

MemoryLimit = Literal["cgroup2", "cgroup1", "rlimits"]
MIN_PROCESS_BYTES = 48 * 2**20
"""The least RLIMIT_AS a Python process of the sandbox can start and run threads in (measured:
`prlimit --as=$((32*2**20)) python3 -c "import threading; ..."` cannot start a thread, 48 MiB
can)."""
REMOVE_GRACE_S = 2.0


@dataclass(frozen=True)
class CallCgroup:
    """The cgroup of one call."""

    path: Path
    version: Literal[1, 2]

    @property
    def procs_file(self) -> str:
        """Where the supervisor writes its pid to join (before it starts anything)."""
        return str(self.path / "cgroup.procs")

    def peak_bytes(self) -> int | None:
        """The most memory the call held at once (None: this kernel does not record it)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return None

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed for going past the bound."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """rmdir once the kernel has let go of the call's (reaped) processes."""
        deadline = time.monotonic() + REMOVE_GRACE_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as error:
                if time.monotonic() > deadline:
                    log.warning("sandbox cgroup %s could not be removed: %s", self.path, error)
                    return
                time.sleep(0.01)


def _limit_files(version: int, limit: int) -> list[tuple[str, str, bool]]:
    """(file, value, required) to write into a fresh cgroup, in order."""
    if version == 2:
        return [
            ("memory.max", str(limit), True),
            ("memory.swap.max", "0", False),  # absent without swap accounting
            ("memory.oom.group", "1", False),  # one OOM kill ends the whole call
        ]
    # memsw (memory + swap) must not be below memory.limit_in_bytes: set after it.
    return [
        ("memory.limit_in_bytes", str(limit), True),
        ("memory.memsw.limit_in_bytes", str(limit), False),
    ]


def make_call_cgroup(parent: Path, version: Literal[1, 2], limit: int) -> CallCgroup:
    """A fresh cgroup under `parent` limited to `limit` bytes; OSError if the kernel refuses."""
    cgroup = CallCgroup(parent / f"mfr-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}", version)
    cgroup.path.mkdir()
    try:
        for name, value, required in _limit_files(version, limit):
            try:
                (cgroup.path / name).write_text(value)
            except OSError:
                if required:
                    raise
        return cgroup
    except BaseException:
        cgroup.remove()
        raise


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per hierarchy, from /proc/self/cgroup: "" is the v2 one, v1
    hierarchies are keyed by each of their controllers."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            found[controller] = path
    return found


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """(mount point, root inside the hierarchy) of the cgroup2 mount (key "") and of each v1
    controller's mount, from /proc/self/mountinfo."""
    mounts: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        fstype, _, options = tail.split(" ", 2)
        root, mount_point = fields.split(" ")[3:5]
        if fstype == "cgroup2":
            mounts.setdefault("", (mount_point, root))
        elif fstype == "cgroup":
            for option in options.split(","):
                mounts.setdefault(option, (mount_point, root))
    return mounts


def _own_directory(key: str) -> Path | None:
    """This process's cgroup directory in hierarchy `key` ("" v2, "memory" v1), if mounted."""
    with contextlib.suppress(OSError, LookupError, ValueError):  # not mounted, not listed
        path, (mount_point, root) = _own_cgroups()[key], _cgroup_mounts()[key]
        relative = os.path.relpath(path, root)
        if not relative.startswith(".."):
            return Path(mount_point) / relative
    return None


def _cgroup_version(directory: Path, enable: bool) -> Literal[1, 2]:
    """2 for a cgroup v2 directory whose children get the memory controller, 1 for a v1 memory
    cgroup; OSError naming why not. `enable`: add memory to a v2 directory's subtree_control
    (only for a directory the operator named: the kernel refuses while it holds processes)."""
    subtree = directory / "cgroup.subtree_control"
    if subtree.exists():
        if "memory" not in subtree.read_text().split():
            if not enable:
                raise OSError(f"{subtree} does not list memory")
            subtree.write_text("+memory")
        return 2
    if (directory / "memory.limit_in_bytes").exists():
        return 1
    raise OSError(f"{directory} is neither a cgroup v2 nor a v1 memory cgroup")


def _candidates(cgroup_parent: str | None) -> list[Path]:
    if cgroup_parent is not None:
        return [Path(cgroup_parent)]
    own = [_own_directory(""), _own_directory("memory")]
    return [path for path in own if path is not None]


@dataclass(frozen=True)
class MemoryBound:
    """How the calls of one Sandbox are held to `limit_bytes` each (module docstring)."""

    kind: MemoryLimit
    limit_bytes: int
    parent: Path | None = None

    @classmethod
    def detect(
        cls, limit_bytes: int, mode: Literal["auto", "cgroup", "rlimits"], cgroup_parent: str | None
    ) -> MemoryBound:
        """The best bound this machine allows (`mode` "cgroup" insists on one; ValueError if
        none can be made, naming why), logged: INFO for a cgroup, WARNING for the fallback."""
        reasons = []
        if mode != "rlimits" and os.geteuid() != 0:
            reasons.append("not root (the code would share our uid and could raise the limit)")
        elif mode != "rlimits":
            for parent in _candidates(cgroup_parent):
                try:
                    version = _cgroup_version(parent, enable=cgroup_parent is not None)
                    make_call_cgroup(parent, version, limit_bytes).remove()  # the probe
                except OSError as error:
                    reasons.append(f"{parent}: {error}")
                    continue
                bound = cls("cgroup2" if version == 2 else "cgroup1", limit_bytes, parent)
                log.info(
                    "sandbox memory bound: %d bytes per call, cgroup v%d under %s",
                    *(limit_bytes, version, parent),
                )
                return bound
            reasons = reasons or ["no cgroup hierarchy with the memory controller is mounted"]
        if mode == "cgroup":
            raise ValueError(f"sandbox memory_limit 'cgroup' is not available: {reasons}")
        log.warning(
            "sandbox memory bound: RLIMIT_AS shares only (%d bytes per call over max_processes "
            "processes), WEAKER than a cgroup%s",
            *(limit_bytes, f" ({'; '.join(reasons)})" if reasons else ""),
        )
        return cls("rlimits", limit_bytes)

    def rlimit_as(self, max_processes: int, tmpfs_bytes: int) -> int:
        """RLIMIT_AS of each process: with a cgroup the whole bound (one allocation larger than
        the call may hold fails at once with MemoryError); without, an equal share of what the
        private tmpfs leaves, so the sum over max_processes processes stays under the bound."""
        if self.kind != "rlimits":
            return self.limit_bytes
        share = (self.limit_bytes - tmpfs_bytes) // max_processes
        if share < MIN_PROCESS_BYTES:
            raise ValueError(
                f"sandbox memory_bytes={self.limit_bytes} leaves {share} bytes per process for "
                f"max_processes={max_processes} (after disk_bytes={tmpfs_bytes}); Python needs "
                f"at least {MIN_PROCESS_BYTES}: raise memory_bytes or lower max_processes"
            )
        return share

    @contextlib.contextmanager
    def call(self) -> Iterator[CallCgroup | None]:
        """A fresh cgroup for one call (removed after it), or None for the rlimits bound."""
        if self.parent is None:
            yield None
            return
        cgroup = make_call_cgroup(self.parent, 1 if self.kind == "cgroup1" else 2, self.limit_bytes)
        try:
            yield cgroup
        finally:
            cgroup.remove()


def node_memory_bytes() -> int:
    """Physical memory of this machine (MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal")
