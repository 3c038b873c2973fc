"""`megatron-fr` started as a user starts it (from the checkout's root), for the end-to-end,
fault and real-engine tests.

One command line, one environment, one reader of a run's JSON-lines files and one way to run a
command to its end, to start a run in the background, to wait on it, to stop it with a STOP
file and to leave nothing of it behind, so that each test says only what it does to the run
and what it asserts of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import psutil

REPO = Path(__file__).resolve().parents[1]
MARKER = "MEGATRON_FR_TEST_RUN"
"""An environment variable every process of a background run inherits: its value finds them
all (the launcher, torchrun's ranks, the engines it starts) whatever their parents became."""


def megatron_fr_command(*args: str) -> list[str]:
    """`python -m megatron_fr ARGS` with this interpreter."""
    return [sys.executable, "-m", "megatron_fr", *args]


def train_args(recipe: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`train RECIPE --run-dir RUN_DIR OVERRIDES`: the arguments of megatron_fr_command."""
    return ["train", str(recipe), "--run-dir", str(run_dir), *overrides]


def run_env(**extra: str) -> dict[str, str]:
    """This process's environment with the checkout first on the path (and `extra`)."""
    return os.environ | {"PYTHONPATH": str(REPO), **extra}


def run_megatron_fr(
    *args: str, timeout_s: float = 900, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `megatron-fr ARGS` to its end; a non-zero exit fails the test with its stderr's
    tail."""
    result = subprocess.run(
        megatron_fr_command(*args),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env or run_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@contextmanager
def served_cpu_engine(model: Path) -> Iterator[str]:
    """`megatron-fr serve --engine cpu` on a free port of 127.0.0.1 for the block (its URL),
    as a server the run is given by URL; stopped after the block."""
    from megatron_fr.utils.net import free_port

    port = free_port()
    args = ["serve", "--model-path", str(model), "--engine", "cpu"]
    engine = subprocess.Popen(
        megatron_fr_command(*args, "--host", "127.0.0.1", "--port", str(port)),
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        engine.terminate()
        engine.wait(30)


def records(run_dir: Path, name: str = "metrics.jsonl", *, running: bool = False) -> list[dict]:
    """The rows of a run's JSON-lines file (none before the file exists); every line must be
    JSON. A run still `running` may be in the middle of a line: then a last line not yet ended
    by its newline is left for the next read."""
    path = run_dir / name
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if running and not text.endswith("\n"):
        lines = lines[:-1]  # being written
    return [json.loads(line) for line in lines if line.strip()]


def step_rows(run_dir: Path, *, running: bool = False) -> list[dict]:
    """metrics.jsonl's rows of optimizer steps (evaluations have rows of their own)."""
    return [row for row in records(run_dir, running=running) if "reward_mean" in row]


def last_step(run_dir: Path) -> int:
    """The last optimizer step the run logged so far (0: none yet), read while it runs."""
    return max((row["step"] for row in step_rows(run_dir, running=True)), default=0)


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def run_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries this marker (Run.marker)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == marker and process.status() != "zombie":
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class Run:
    """One start of `megatron-fr ARGS` in the background, in a session of its own, its output
    in a log file beside the run directory. As a context manager it leaves nothing behind: a
    start still running at the end of the block is SIGKILLed with its whole session."""

    def __init__(self, args: list[str], log_dir: Path, marker: str | None = None) -> None:
        self.marker = marker or uuid.uuid4().hex
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / f"start-{uuid.uuid4().hex[:6]}.log", "w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            megatron_fr_command(*args),
            env=run_env(**{MARKER: self.marker}),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=REPO,
        )

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def ended(self) -> bool:
        return self.process.poll() is not None

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def wait_for(self, predicate: Callable[[], object], timeout_s: float, what: str) -> None:
        """Until `predicate` holds while the run goes on; the run's end first fails the test
        with its output's tail."""
        wait_until(lambda: predicate() or self.ended(), timeout_s, what)
        assert not self.ended(), f"the run ended before {what}:\n{self.output()[-4000:]}"

    def stop(self, run_dir: Path, timeout_s: float) -> tuple[int | None, float]:
        """A STOP file in `run_dir`: the exit code (None: still running after `timeout_s`) and
        the seconds from the request to the end."""
        (run_dir / "STOP").touch()
        asked = time.monotonic()
        try:
            code: int | None = self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - asked

    def stop_cleanly(self, run_dir: Path, timeout_s: float = 300) -> None:
        """A STOP file, and the run must end with exit 0 within `timeout_s`."""
        code, _ = self.stop(run_dir, timeout_s)
        assert code == 0, self.output()[-4000:]

    def kill(self) -> None:
        """SIGKILL to the whole session if the start still runs, and its exit collected."""
        if not self.ended():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.wait(60)

    def wait_gone(self, timeout_s: float = 30) -> None:
        """Until no process of the run is left (engines and ranks included)."""
        wait_until(lambda: not run_processes(self.marker), timeout_s, "no process of the run left")
