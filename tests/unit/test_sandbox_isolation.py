"""The sandbox stops hostile code, reports it as a tool error, and leaves no process behind.

Each OS layer is tested with the audit hook OFF (so the hook cannot be what stopped it), and
the hook is tested alone by running sandbox_runner.py without any OS isolation. "Leaves no
process behind" is checked with psutil: no process of the run's uid, none in its process
group. The fork bomb is safe for the machine: RLIMIT_NPROC on the run's own uid (16) and the
pid namespace bound it, and the wall timeout ends it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from megatron_fr.envs.sandbox import RUNNER, Sandbox, SandboxConfig, SandboxError, SandboxResult

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = os.geteuid() == 0 and Sandbox(SandboxConfig()).isolation == "namespaces"
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="needs root with CAP_SYS_ADMIN")

OS_ONLY = SandboxConfig(isolation="namespaces", audit_hook=False, wall_timeout_s=5)
WITH_HOOK = SandboxConfig(isolation="namespaces", audit_hook=True, wall_timeout_s=5)


def leftovers(result: SandboxResult) -> list[int]:
    """Processes of the run still alive (zombies included: a zombie is still a process)."""
    found = []
    for proc in psutil.process_iter(["pid", "uids"]):
        try:
            if proc.info["uids"].real == result.uid or os.getpgid(proc.pid) == result.pgid:
                found.append(proc.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def run(code: str, config: SandboxConfig = OS_ONLY) -> SandboxResult:
    result = Sandbox(config).run(code)
    assert leftovers(result) == [], f"processes left behind: {leftovers(result)}"
    assert result.uid != os.getuid(), "the code ran as a uid of its own"
    return result


@pytest.fixture
def listener():
    """A TCP server on the host's loopback, counting the connections it gets."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@needs_namespaces
def test_sandbox_runs_code_in_a_private_directory() -> None:
    code = (
        "import os, tempfile\n"
        "open('notes.txt', 'w').write('x' * 10)\n"
        "print(os.getcwd(), os.environ['HOME'], sorted(os.listdir('.')), tempfile.gettempdir())\n"
        "print(sorted(os.environ))"
    )
    result = run(code)
    assert result.status == "ok" and not result.tool_error, result
    first, second = result.stdout.splitlines()
    assert first == "/sandbox /sandbox ['notes.txt'] /tmp"
    assert second == "['HOME', 'LANG', 'PATH', 'TMPDIR']", "no PYTHONPATH, no secrets"


@needs_namespaces
@pytest.mark.parametrize("config", [OS_ONLY, WITH_HOOK], ids=["os-only", "os+hook"])
def test_sandbox_network_socket_is_refused(config: SandboxConfig, listener) -> None:
    port, accepted = listener
    code = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "print('connected')"
    )
    result = run(code, config)
    assert result.status == "error" and result.tool_error
    assert "connected" not in result.stdout
    expected = "Network is unreachable" if not config.audit_hook else "network access"
    assert expected in result.stderr, result.stderr
    assert accepted == []


@needs_namespaces
@pytest.mark.parametrize("config", [OS_ONLY, WITH_HOOK], ids=["os-only", "os+hook"])
@pytest.mark.parametrize(
    "path", [str(REPO / "README.md"), os.path.expanduser("~/.bashrc"), "/etc/passwd"]
)
def test_sandbox_read_outside_its_directory_fails(config: SandboxConfig, path: str) -> None:
    result = run(f"print(open({path!r}).read())", config)
    assert result.status == "error" and result.stdout == ""
    # The hook lets the sandbox's own /tmp through, so a checkout under /tmp (as CI's clones
    # are) is refused by the mount namespace instead: the file is not in the sandbox's root.
    hook_refuses = config.audit_hook and not path.startswith("/tmp/")
    expected = "PermissionError" if hook_refuses else "FileNotFoundError"
    assert expected in result.stderr, result.stderr


@needs_namespaces
def test_sandbox_repository_and_home_are_not_even_listed() -> None:
    code = f"import os\nprint(os.path.exists({str(REPO)!r}), os.listdir(os.path.expanduser('~')))"
    assert run(code).stdout == "False []\n"


@needs_namespaces
def test_sandbox_fork_bomb_is_bounded_and_killed() -> None:
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    config = OS_ONLY.model_copy(update={"wall_timeout_s": 2.0, "max_processes": 16})
    result = run(bomb, config)
    assert result.status == "timeout" and result.tool_error
    assert 2.0 <= result.elapsed_s < 4.0, result.elapsed_s


@needs_namespaces
def test_sandbox_fork_limit_is_per_run() -> None:
    code = (
        "import os, time\nmade = failed = 0\n"
        "for _ in range(40):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        failed += 1\n"
        "        continue\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
        "    made += 1\n"
        "print(made, failed)"
    )
    result = run(code, OS_ONLY.model_copy(update={"max_processes": 8}))
    assert result.stdout == "7 33\n", result  # 8 processes with the first one
    assert result.elapsed_s < 3, "the sleeping children died with the run"


@needs_namespaces
def test_sandbox_allocating_10_gb_fails_with_memory_error() -> None:
    result = run("x = bytearray(10 * 2**30)\nprint(len(x))")
    assert result.status == "error" and "MemoryError" in result.stderr


@needs_namespaces
def test_sandbox_printing_1_gb_is_cut_and_killed() -> None:
    code = "import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    result = run(code)
    assert result.status == "output_limit" and result.tool_error
    assert len(result.stdout) == OS_ONLY.max_output_bytes
    assert result.elapsed_s < 2, result.elapsed_s


@needs_namespaces
def test_sandbox_sleeping_forever_is_killed_at_the_deadline() -> None:
    config = OS_ONLY.model_copy(update={"wall_timeout_s": 1.5})
    result = run("import time\nprint('start', flush=True)\ntime.sleep(10**6)", config)
    assert result.status == "timeout" and result.exit_code is None
    assert result.stdout == "start\n", "output before the kill is kept"
    assert 1.5 <= result.elapsed_s < 3.0, result.elapsed_s


@needs_namespaces
def test_sandbox_daemon_that_escapes_the_session_dies_with_the_run() -> None:
    """setsid + double fork leaves the process group; the pid namespace still ends it."""
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(10**6)\n    os._exit(0)\n"
        "print('parent done')"
    )
    result = run(code)
    assert result.status == "ok" and result.stdout == "parent done\n"


@needs_namespaces
def test_sandbox_cpu_time_limit() -> None:
    config = OS_ONLY.model_copy(update={"cpu_time_s": 1, "wall_timeout_s": 10})
    result = run("while True:\n    pass", config)
    assert result.status == "cpu_limit" and result.tool_error
    assert result.elapsed_s < 4, result.elapsed_s


@needs_namespaces
def test_sandbox_disk_use_is_bounded() -> None:
    big = run("open('big', 'wb').write(b'x' * 20 * 2**20)")  # RLIMIT_FSIZE 8 MiB
    assert big.status == "error" and "File too large" in big.stderr
    many = run("for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * 7 * 2**20)")
    assert many.status == "error" and "No space left on device" in many.stderr  # 32 MiB tmpfs


@needs_namespaces
def test_sandbox_errors_and_exit_codes_are_reported() -> None:
    failed = run("def f():\n    return 1 / 0\nf()")
    assert failed.status == "error" and failed.exit_code == 1
    assert 'File "main.py", line 2, in f' in failed.stderr
    assert "ZeroDivisionError" in failed.stderr and "<string>" not in failed.stderr
    assert run("raise SystemExit(3)").exit_code == 3


@needs_namespaces
def test_sandbox_concurrent_runs_do_not_share_anything() -> None:
    sandbox = Sandbox(OS_ONLY)
    code = "import os\nopen('mine', 'w').write(str(os.getuid()))\nprint(os.listdir('.'))"
    results: list[SandboxResult] = []
    threads = [threading.Thread(target=lambda: results.append(sandbox.run(code))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert [r.stdout for r in results] == ["['mine']\n"] * 4
    assert len({r.uid for r in results}) == 4


def _run_hook_only(code: str, workdir: Path) -> subprocess.CompletedProcess:
    """sandbox_runner.py with its audit hook and no OS isolation at all (harmless code only)."""
    sandbox = Sandbox(SandboxConfig(isolation="rlimits"))
    policy = {
        "enabled": True,
        "read_roots": sandbox._python_dirs,
        "write_roots": [str(workdir)],
    }
    command = [sandbox._python, "-I", "-u", "-c", RUNNER.read_text(), json.dumps(policy)]
    return subprocess.run(
        command, input=code, cwd=workdir, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        (f"open({str(REPO / 'README.md')!r}).read()", "reading"),
        ("import os; os.listdir('/')", "reading /"),
        ("open('/tmp/outside-the-workdir', 'w')", "writing"),
        ("import socket; socket.socket()", "network access"),
        ("import socket; socket.getaddrinfo('localhost', 80)", "network access"),
        ("import subprocess; subprocess.run(['true'])", "starting programs"),
        ("import os; os.system('true')", "starting programs"),
        ("import ctypes; ctypes.CDLL(None)", "ctypes"),
        ("import gc; gc.get_objects()", "gc introspection"),
        ("import gc; gc.get_referrers(object)", "gc introspection"),
    ],
)
def test_sandbox_audit_hook_alone_refuses(code: str, refused: str, tmp_path: Path) -> None:
    done = _run_hook_only(code, tmp_path)
    assert done.returncode == 1, done
    assert f"PermissionError: sandbox: {refused}" in done.stderr, done.stderr
    assert not Path("/tmp/outside-the-workdir").exists()


def test_sandbox_audit_hook_allows_the_workdir_and_the_stdlib(tmp_path: Path) -> None:
    code = (
        "import fractions, json, statistics\n"
        "open('out.txt', 'w').write('ok')\n"
        "print(open('out.txt').read(), fractions.Fraction(1, 3) * 3)"
    )
    done = _run_hook_only(code, tmp_path)
    assert (done.returncode, done.stdout) == (0, "ok 1\n"), done.stderr


SWITCH_OFF_THE_HOOK = """
import gc
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__name__", "") == "hook" and obj.__closure__:
        for cell in obj.__closure__:
            if isinstance(cell.cell_contents, list):
                cell.cell_contents.append(True)  # its re-entrancy flag: every event now passes
"""


@needs_namespaces
def test_sandbox_hook_switched_off_leaves_the_os_layers_holding(listener) -> None:
    """The hook is a convenience: with it refused nothing more than the OS already refuses.
    The gc route to its state is refused; with the hook off (OS_ONLY stands for any way
    round it) the same attack still finds no file and no network."""
    refused = run(SWITCH_OFF_THE_HOOK + "print('off')", WITH_HOOK)
    assert "PermissionError: sandbox: gc introspection" in refused.stderr, refused
    port, accepted = listener
    attack = SWITCH_OFF_THE_HOOK + (
        f"print(open({str(REPO / 'README.md')!r}).read()[:10])\n"
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
    )
    contained = run(attack, OS_ONLY)
    assert "FileNotFoundError" in contained.stderr and contained.stdout == ""
    assert accepted == []


@needs_namespaces
def test_sandbox_code_of_any_size_and_bytes_reaches_the_interpreter() -> None:
    """The code travels in a file, not argv: 1 MB (argv caps one string at 128 KiB) and
    control bytes are fine; a NUL is the interpreter's error, reported, not a launch failure."""
    big = "x = 0\n" + "x += 1\n" * 150_000 + "print(x, '\x01\x7f\u00e9')"
    sandbox = Sandbox(OS_ONLY.model_copy(update={"max_code_bytes": 2_000_000}))
    assert sandbox.run(big).stdout == "150000 \x01\x7f\u00e9\n"
    nul = sandbox.run("print(1)\x00")
    assert nul.status == "error" and "null bytes" in nul.stderr


def test_sandbox_refuses_oversized_code() -> None:
    with pytest.raises(ValueError, match="longer than"):
        Sandbox(SandboxConfig(max_code_bytes=100)).run("x = 1\n" * 100)


BASE_UNDER_HOME = Sandbox()._python.startswith(os.path.expanduser("~") + "/")
RLIMITS = SandboxConfig(
    isolation="rlimits",
    # As root the sandbox uid must be able to run the interpreter: not one under /root.
    interpreter="/usr/bin/python3" if BASE_UNDER_HOME else None,
    wall_timeout_s=1.5,
)
RLIMITS_USABLE = os.geteuid() == 0 and (
    not BASE_UNDER_HOME or os.access("/usr/bin/python3", os.X_OK)
)


@pytest.mark.skipif(not RLIMITS_USABLE, reason="needs root and an interpreter others may run")
def test_sandbox_rlimits_fallback_stops_the_same_code(listener) -> None:
    """Without namespaces: the uid, rlimits, the parent's limits and the audit hook. The file
    and network refusals come from the hook alone in this mode (the module docstring)."""
    config = RLIMITS
    port, accepted = listener
    network = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))", config)
    assert network.status == "error" and "network access" in network.stderr
    assert accepted == []
    secret = run(f"print(open({str(REPO / 'README.md')!r}).read())", config)
    assert secret.status == "error" and "PermissionError" in secret.stderr
    home = run("print(open('/root/.bashrc').read())", config)
    assert home.status == "error" and home.stdout == ""
    memory = run("x = bytearray(10 * 2**30)", config)
    assert memory.status == "error" and "MemoryError" in memory.stderr
    forks = run(
        "import os, time\nmade = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        continue\n    if pid == 0:\n        time.sleep(30)\n"
        "        os._exit(0)\n    made += 1\nprint(made)",
        config.model_copy(update={"max_processes": 8}),
    )
    assert forks.stdout == "7\n", forks
    assert run("import time\ntime.sleep(10**6)", config).status == "timeout"
    flood = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", config)
    assert flood.status == "output_limit"
    daemon = run(
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(10**6)\n    os._exit(0)\nprint('done')",
        config,
    )
    assert daemon.status == "ok" and daemon.isolation == "rlimits"


@needs_namespaces
def test_sandbox_code_cannot_fake_an_infrastructure_failure() -> None:
    code = "import sys\nsys.stderr.write('sandbox setup failed: oops')\nsys.exit(125)"
    result = run(code)
    assert (result.status, result.exit_code) == ("error", 125)


@pytest.mark.skipif(
    os.geteuid() != 0 or not BASE_UNDER_HOME, reason="needs root and an interpreter under ~"
)
def test_sandbox_that_cannot_be_built_raises() -> None:
    """As root in rlimits mode the sandbox uid cannot run an interpreter under /root."""
    with pytest.raises(SandboxError, match="Permission denied"):
        Sandbox(SandboxConfig(isolation="rlimits")).run("print(1)")
