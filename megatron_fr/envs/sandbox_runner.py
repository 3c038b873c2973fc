"""Runs the model's code inside the sandbox: `python -I -u -c <this source> HOOK_JSON`, the
code (UTF-8, surrogates passed through) on stdin.

sandbox_boot.py exec's a fresh interpreter on this source after dropping privileges and
setting the limits. It reads the code from stdin (an anonymous file: any byte, NUL included,
is data; the interpreter then rejects what is not Python as the code's own error), points
stdin at /dev/null, installs the audit hook (when HOOK_JSON enables it) and executes the code
as the `__main__` module, with tracebacks that show the model's own lines only.

The audit hook is a convenience, not a boundary: it refuses, from Python, network sockets,
starting programs, ctypes, file access outside the allowed directories and the gc
introspection that reaches its own state, so the common cases fail fast with a clear
PermissionError. It runs in the same process as the code it watches, so it can be got round:
a path checked here can be swapped for a symlink before the kernel opens it (another thread
or process racing the check), code that reaches raw syscalls (a C extension, an interpreter
bug) never raises the events, and Python-level ways to reach the hook's state other than gc
may exist. The OS layers (namespaces, chroot, uid, rlimits, the call's cgroup) are what hold
then; in the "rlimits" isolation mode there are none for the network and the filesystem, which
is why that mode is reported as weaker (SANDBOX.md). Standard library only; it is never
imported by the project.
"""

import json
import os
import sys
from typing import Any

WRITE_EVENTS = frozenset(
    {
        "os.chmod",
        "os.chown",
        "os.link",
        "os.mkdir",
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.symlink",
        "os.truncate",
        "os.utime",
        "shutil.rmtree",
        "shutil.copyfile",
    }
)
READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "glob.glob"})
PROGRAM_EVENTS = frozenset(
    {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn"}
)
CTYPES_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata"})
SOCKET_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
NAME_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"})
INTROSPECTION_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
"""How code finds this hook's closure (and flips its re-entrancy flag to switch it off)."""


def _under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def install_hook(read_roots: list[str], write_roots: list[str]) -> None:
    """Refuse, from Python, what the sandbox policy refuses (see the module docstring)."""
    import socket

    busy: list[bool] = []

    def resolve(path: Any) -> str:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.fspath(path))

    def refuse(what: str) -> None:
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(event: str, path: Any, writing: bool) -> None:
        if path is None or isinstance(path, int):
            return  # an already open descriptor
        real = resolve(path)
        if not _under(real, write_roots if writing else read_roots + write_roots):
            refuse(f"{'writing' if writing else 'reading'} {path!s} ({event})")

    def is_network(event: str, args: tuple[Any, ...]) -> bool:
        """A socket that is not AF_UNIX (created, connected, bound, sent on) or a DNS lookup."""
        if event == "socket.__new__":
            return args[1] != socket.AF_UNIX
        if event in SOCKET_EVENTS:
            return args[0].family != socket.AF_UNIX
        return event in NAME_EVENTS

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if busy:  # the hook's own realpath() calls
            return
        busy.append(True)
        try:
            if event == "open":
                path, mode, flags = args
                writing = (mode is not None and any(c in mode for c in "wax+")) or bool(
                    flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
                )
                check_path(event, path, writing)
            elif event in READ_EVENTS:
                check_path(event, args[0] if args else ".", False)
            elif event in WRITE_EVENTS:
                check_path(event, args[0], True)
            elif event in PROGRAM_EVENTS:
                refuse("starting programs")
            elif event in CTYPES_EVENTS:
                refuse("ctypes")
            elif event in INTROSPECTION_EVENTS:
                refuse("gc introspection")
            elif is_network(event, args):
                refuse("network access")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def run(code: str) -> None:
    """Execute `code` as __main__; an uncaught exception prints the model's frames, exits 1."""
    import linecache
    import traceback

    filename = "main.py"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    sys.argv = [filename]
    sys.path.insert(0, os.getcwd())
    namespace = {"__name__": "__main__", "__file__": filename, "__builtins__": __builtins__}
    try:
        exec(compile(code, filename, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as error:
        # This runner's own frames (the exec, the audit hook) are "<string>": not the model's.
        frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != "<string>"]
        header = ["Traceback (most recent call last):\n"] if frames else []  # did not compile
        lines = [*header, *traceback.format_list(frames)]
        lines += traceback.format_exception_only(type(error), error)
        sys.stderr.write("".join(lines))
        sys.exit(1)


def read_code() -> str:
    """The model's code, from stdin; stdin is /dev/null afterwards (the code reads nothing)."""
    code = sys.stdin.buffer.read().decode("utf-8", "surrogatepass")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return code


def main() -> None:
    policy = json.loads(sys.argv[1])
    code = read_code()
    if policy["enabled"]:
        install_hook(policy["read_roots"], policy["write_roots"])
    del policy
    run(code)


if __name__ == "__main__":
    main()
