"""The sandbox's own side: `python -I sandbox_boot.py CONFIG_JSON`, the model's code on stdin.

stdin is an anonymous file holding the code; it stays fd 0 down to the runner, which reads it
(sandbox_runner.py). The code is never in an argv or the environment, where a NUL byte would
make the exec fail.

Started by megatron_fr.envs.sandbox (the parent), never imported by it. Standard library only,
and nothing of this repository is imported: in "namespaces" mode the repository is invisible
once the root is built, and the interpreter that runs the model's code is a fresh one
(sandbox_runner.py, passed as source) that carries no project module and no ctypes.

"namespaces" mode (root, Linux):

    supervisor  (the parent's child, its own session, a child subreaper; outer pid namespace)
      │  joins the call's cgroup (cfg["cgroup_procs"], when there is one) before anything else
      │  unshare(mount, net, pid, ipc, uts) then fork; waits; exits with the child's status
      │  once nothing of the tree is left; SIGUSR1 from the parent = kill everything now
      └─ init   (pid 1 of the new pid namespace, still root): mounts a size-limited tmpfs as the
           │    new root, binds /usr, /lib* and the interpreter's prefix read-only, a fresh
           │    /proc, /dev/{null,zero,random,urandom}, then chroot; forks the runner; reaps
           └─ runner  drops to the sandbox's own uid/gid (no groups, no_new_privs), sets the
                      rlimits, cd /sandbox, exec's the interpreter on sandbox_runner.py's source

    When the runner exits, init exits with its status, and the kernel kills every process
    left in the pid namespace. init and supervisor carry PR_SET_PDEATHSIG=SIGKILL, so the
    parent killing the supervisor (timeout, output cap) takes the whole namespace down.

"rlimits" mode (the fallback where namespaces are not available): the supervisor's child is
the runner; as their subreaper the supervisor kills and reaps every orphan of the tree before
it exits (a process that escapes as a child of a live process of the tree is found once that
one is killed). The parent also sweeps the run's process group and, as root, its uid.

The parent never needs to SIGKILL the supervisor (only as a last resort): were it killed,
init would be re-parented to the host's pid 1, which in a container may never reap it.

A sandbox that could not be built (an infrastructure failure, not the model's code) says
why on the report pipe (cfg["report_fd"], close-on-exec, so the model's code never holds it
and cannot fake such a failure) and exits with status 125.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

SETUP_FAILED = 125

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")
SYSTEM_FILES = ("/etc/ld.so.cache",)
"""The dynamic loader's cache: programs the code starts find their libraries (nothing else of
/etc is visible)."""

_libc = ctypes.CDLL(None, use_errno=True)


Config = dict[str, Any]
"""The parent's CONFIG_JSON (megatron_fr.envs.sandbox builds it)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def _die_with_parent(parent_alive: Callable[[], bool]) -> None:
    """SIGKILL this process when its parent exits (and now, if it already has)."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if not parent_alive():
        os._exit(SETUP_FAILED)


def _writer_alive(read_end: int) -> bool:
    """Whether a process still holds the write end of this pipe (we closed our copy)."""
    try:
        return os.read(read_end, 1) != b""
    except BlockingIOError:
        return True


def _exit_like(status: int) -> NoReturn:
    """Exit as the waited-for process did: its code, or 128 + the signal that killed it."""
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _bind_read_only(source: str, target: str) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mirror(path: str, root: str) -> None:
    """Make `path` (a directory, file or symlink of the host) appear read-only at root+path."""
    target = root + path
    if os.path.islink(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(path), target)
    elif os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
        _bind_read_only(path, target)
    elif os.path.isfile(path):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
        _bind_read_only(path, target)


def _build_root(cfg: Config) -> None:
    """The new root: a tmpfs holding read-only views of the system and the interpreter, a fresh
    /proc of this pid namespace, and the writable /sandbox and /tmp (the tmpfs size bounds them)."""
    root = cfg["root_dir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_bytes']},mode=755")
    for path in (*SYSTEM_DIRS, *cfg["python_dirs"], *SYSTEM_FILES):
        if os.path.lexists(path) and not os.path.lexists(root + path):
            _mirror(path, root)
    os.makedirs(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path, mode in (("/tmp", 0o1777), (cfg["workdir"], 0o700)):
        os.makedirs(root + path)
        os.chmod(root + path, mode)
    os.chown(root + cfg["workdir"], cfg["uid"], cfg["uid"])
    os.chdir(root)
    os.chroot(root)
    os.chdir(cfg["workdir"])


def _limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def _become_runner(cfg: Config, runner_source: str, parent_alive: Callable[[], bool]) -> NoReturn:
    """Drop privileges, set the limits, exec the fresh interpreter (the code is on stdin)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    _die_with_parent(parent_alive)  # after setuid, which clears the parent-death signal
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_FSIZE, cfg["max_file_bytes"])
    _limit(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    if cfg["max_processes"] is not None:
        _limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    # Soft CPU limit sends SIGXCPU (reported as "cpu_limit"); the hard one a second later kills.
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_time_s"], cfg["cpu_time_s"] + 1))
    _limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    os.chdir(cfg["workdir"])
    env = {
        "HOME": cfg["workdir"],
        "TMPDIR": cfg["tmpdir"],
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
    }
    hook = json.dumps(cfg["hook"])
    argv = [cfg["python"], "-I", "-u", "-c", runner_source, hook]
    os.execve(cfg["python"], argv, env)


def _init(cfg: Config, runner_source: str) -> NoReturn:
    """pid 1 of the sandbox: build the root, start the runner, reap until the runner ends."""
    _build_root(cfg)
    runner = os.fork()
    if runner == 0:
        _start_runner(cfg, runner_source, lambda: os.getppid() == 1)
    while True:  # orphans of the runner are re-parented to us: reap them as well
        pid, status = os.wait()
        if pid == runner:
            _exit_like(status)  # leaving pid 1 kills whatever is left in the namespace


def _start_runner(cfg: Config, runner_source: str, parent_alive: Callable[[], bool]) -> NoReturn:
    try:
        _become_runner(cfg, runner_source, parent_alive)
    except BaseException as error:  # exec failed: report, never fall through to the caller
        _report(cfg, f"runner: {error}")
    os._exit(SETUP_FAILED)


def _children() -> list[int]:
    """PIDs whose parent is this process (orphans of the tree come here: we are its reaper)."""
    me = os.getpid()
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                found.append(int(entry))
    return found


def _kill_children(*_: object) -> None:
    for pid in _children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _reap_everything() -> None:
    """Kill and reap every remaining descendant (each one ends up our child, being our
    subreaper's orphan, until none is left)."""
    while True:
        _kill_children()
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.005)


def _supervise(cfg: Config, runner_source: str) -> NoReturn:
    """The parent's child: one child (init, or the runner itself in "rlimits" mode), every
    orphan of the tree reaped here, SIGUSR1 from the parent = kill it all now. Exits, with
    the child's status, only once nothing of the tree is left: the parent never has to kill
    this process, whose orphaned children would otherwise be left to pid 1 (which, in a
    container, may never reap them)."""
    if cfg["cgroup_procs"]:  # first: every process of the call is then born inside it
        with open(cfg["cgroup_procs"], "w") as procs:
            procs.write(str(os.getpid()))
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    supervisor = os.getpid()
    namespaces = cfg["isolation"] == "namespaces"
    if namespaces:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        _check(_libc.unshare(flags), "unshare")
    # init cannot see its parent (it is outside the new pid namespace): a pipe whose write end
    # only the supervisor keeps tells it whether the supervisor is still there.
    alive_read, alive_write = os.pipe()
    os.set_blocking(alive_read, False)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        os.close(alive_write)
        if not namespaces:
            os.close(alive_read)
            _start_runner(cfg, runner_source, lambda: os.getppid() == supervisor)
        try:
            _die_with_parent(lambda: _writer_alive(alive_read))
            os.close(alive_read)
            _init(cfg, runner_source)
        except BaseException as error:
            _report(cfg, f"init: {error}")
        os._exit(SETUP_FAILED)
    os.close(alive_read)
    _, status = os.waitpid(child, 0)
    _reap_everything()
    _exit_like(status)


def _report(cfg: Config, message: str) -> None:
    with contextlib.suppress(OSError):
        os.write(cfg["report_fd"], message.encode(errors="replace")[:4000])


def main() -> None:
    signal.signal(signal.SIGUSR1, _kill_children)  # first: the parent may ask at any time
    cfg = json.loads(sys.argv[1])
    os.set_inheritable(cfg["report_fd"], False)  # close-on-exec: the runner's exec drops it
    with open(cfg["runner_path"], encoding="utf-8") as runner:
        runner_source = runner.read()
    try:
        _die_with_parent(lambda: os.getppid() == cfg["parent_pid"])
        _supervise(cfg, runner_source)
    except BaseException as error:
        _report(cfg, f"supervisor: {error}")
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
