"""Runs the model's code inside the sandbox: `python -I -u -c <this source> HOOK_JSON CODE`.

sandbox_boot.py exec's a fresh interpreter on this source after dropping privileges and
setting the limits. It installs the audit hook (when HOOK_JSON enables it) and then executes
CODE as the `__main__` module, with tracebacks that show the model's own lines only.

The audit hook is a tripwire, not a boundary: it refuses, from Python, network sockets,
starting programs, ctypes, and file access outside the allowed directories, so the common
cases fail fast with a clear PermissionError. Code that reaches raw syscalls (a C extension)
is not stopped by it; the OS layers (namespaces, chroot, uid, rlimits) are what holds then.
Standard library only; it is never imported by the project.
"""

import json
import os
import sys

WRITE_EVENTS = frozenset(
    {
        "os.chmod", "os.chown", "os.link", "os.mkdir", "os.remove", "os.rename", "os.rmdir",
        "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile",
    }
)  # fmt: skip
READ_EVENTS = frozenset({"os.listdir", "os.scandir", "os.chdir", "glob.glob"})
PROGRAM_EVENTS = frozenset(
    {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn"}
)
CTYPES_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata"})
SOCKET_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
NAME_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"})


def _under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def install_hook(read_roots, write_roots):
    """Refuse, from Python, what the sandbox policy refuses (see the module docstring)."""
    import socket

    busy = []

    def resolve(path):
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.fspath(path))

    def refuse(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(event, path, writing):
        if path is None or isinstance(path, int):
            return  # an already open descriptor
        real = resolve(path)
        if not _under(real, write_roots if writing else read_roots + write_roots):
            refuse(f"{'writing' if writing else 'reading'} {path!s} ({event})")

    def is_network(event, args):
        """A socket that is not AF_UNIX (created, connected, bound, sent on) or a DNS lookup."""
        if event == "socket.__new__":
            return args[1] != socket.AF_UNIX
        if event in SOCKET_EVENTS:
            return args[0].family != socket.AF_UNIX
        return event in NAME_EVENTS

    def hook(event, args):
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
            elif is_network(event, args):
                refuse("network access")
        finally:
            busy.pop()

    sys.addaudithook(hook)


def run(code):
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
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
        lines += traceback.format_exception_only(type(error), error)
        sys.stderr.write("".join(lines))
        sys.exit(1)


def main():
    policy = json.loads(sys.argv[1])
    code = sys.argv[2]
    if policy["enabled"]:
        install_hook(policy["read_roots"], policy["write_roots"])
    del policy
    run(code)


if __name__ == "__main__":
    main()
