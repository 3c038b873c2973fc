"""Math answers: extraction from a response, and equivalence with the reference via math-verify,
in worker processes under a hard deadline.

    grade(response, gold)
      ─► extract_answer: the last \\boxed{...}, else "answer is X" / "Answer: X" / "#### X",
         else the last non-empty line
      ─► an idle worker process: math_verify.parse (both sides) + verify, with math-verify's own
         timeouts (signal.alarm: they only work in a process's main thread, which is why the
         grading runs in worker processes and never in the caller's thread)
      ─► no answer within deadline_s: the worker is SIGKILLed and replaced, the grade is
         "timeout" (a big-integer computation in C does not check signals, so the alarm
         alone cannot bound every input)

math-verify's order matters: verify(gold, prediction) treats the gold as the reference (e.g. a
gold "x = 3" accepts "3"). Answers are wrapped in $...$ so that plain text such as "[1,2]" is
read as LaTeX (math-verify extracts nothing from it otherwise).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import PositiveFloat, PositiveInt

from megatron_fr.config.base import StrictModel

GradeStatus = Literal["correct", "incorrect", "no_answer", "timeout"]

_ANSWER_IS = re.compile(
    r"(?:final answer|answer)\s*(?:is|:|=)\s*(.+?)\s*$|^####\s*(.+?)\s*$",
    re.IGNORECASE | re.MULTILINE,
)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
STARTUP_TIMEOUT_S = 120.0
REPO_ROOT = Path(__file__).resolve().parents[2]


class MathGraderConfig(StrictModel):
    """How answers are compared and how long a comparison may take."""

    workers: PositiveInt = 1
    """Worker processes (each holds math-verify, ~100 MB); concurrent grades beyond this wait."""
    parse_timeout_s: PositiveInt = 3
    """math-verify's own parsing timeout, per side (whole seconds: signal.alarm)."""
    verify_timeout_s: PositiveInt = 3
    """math-verify's own comparison timeout (whole seconds)."""
    deadline_s: PositiveFloat = 10.0
    """Hard limit of one grade, waiting for a worker excluded: the worker is killed past it."""
    max_answer_chars: PositiveInt = 1000
    """Longer extracted answers are graded "incorrect" without being parsed."""


@dataclass(frozen=True)
class Grade:
    status: GradeStatus
    answer: str | None
    """The answer extracted from the response (None: nothing to grade)."""
    elapsed_s: float

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


def _boxed_contents(text: str) -> list[str]:
    """The brace-balanced contents of every \\boxed{...} / \\fbox{...}, in order."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


@dataclass(frozen=True)
class Answer:
    text: str
    latex: bool
    """True for a boxed or stated answer (read as one LaTeX expression); False for a last line,
    from which math-verify picks the final expression itself ("so the total is 42" -> 42)."""


def extract_answer(response: str) -> Answer | None:
    """The final answer a response gives (see the module docstring), or None."""
    boxed = _boxed_contents(response)
    if boxed:
        return Answer(boxed[-1].strip(), latex=True) if boxed[-1].strip() else None
    stated = _ANSWER_IS.findall(response)
    if stated:
        text = next(part for part in stated[-1] if part).strip().rstrip(".").strip("$ ")
        return Answer(text, latex=True) if text else None
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return Answer(lines[-1], latex=False) if lines else None


def _verify(
    answer: str, latex: bool, gold: str, parse_timeout_s: int, verify_timeout_s: int
) -> bool:
    """Runs in a worker process (main thread, so math-verify's alarms work)."""
    from math_verify import parse, verify

    gold_parsed = parse(_as_latex(gold), parsing_timeout=parse_timeout_s)
    answer_parsed = parse(_as_latex(answer) if latex else answer, parsing_timeout=parse_timeout_s)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=verify_timeout_s))


def _as_latex(text: str) -> str:
    text = text.strip()
    return text if text.startswith("$") else f"${text}$"


def worker_main() -> None:
    """`python -m megatron_fr.envs.math_grader`: one JSON request per stdin line, one JSON
    answer per stdout line (true/false), until stdin closes."""
    import math_verify  # noqa: F401  (imported once, before the first request)

    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            verdict = _verify(*json.loads(line))
        except Exception:  # an answer math-verify chokes on is a wrong answer
            verdict = False
        print(json.dumps(verdict), flush=True)


class _Worker:
    """One worker process, spoken to over its pipes; killed by its PID."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_fr.envs.math_grader"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # math-verify logs every timeout there
            env=env,
            bufsize=0,
        )
        if self.proc.stdin is None or self.proc.stdout is None:  # both opened as pipes above
            raise RuntimeError("the math-verify worker's stdin and stdout are not pipes")
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._buffer = b""

    def send(self, request: object) -> None:
        self._stdin.write(json.dumps(request).encode() + b"\n")

    def receive(self, timeout_s: float) -> object:
        """The next answer; TimeoutError after `timeout_s`, EOFError if the worker died."""
        deadline = time.monotonic() + timeout_s
        fd = self._stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError("math-verify worker exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stdin.close()
        self._stdout.close()


class MathGrader:
    """Thread-safe grader over `config.workers` worker processes, started on first use (fresh
    interpreters, never forks of the caller, whose threads fork would copy mid-state)."""

    def __init__(self, config: MathGraderConfig | None = None) -> None:
        self.config = config or MathGraderConfig()
        self._idle: list[_Worker] = []
        self._count = 0
        self._available = threading.Condition()
        self._closed = False

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def grade(self, response: str, gold: str) -> Grade:
        """Grade the final answer of `response` against `gold` (never raises for bad input)."""
        start = time.monotonic()
        answer = extract_answer(response)
        if answer is None:
            return Grade("no_answer", None, time.monotonic() - start)
        if len(answer.text) > self.config.max_answer_chars:
            return Grade("incorrect", answer.text, time.monotonic() - start)
        return Grade(self._compare(answer, gold), answer.text, time.monotonic() - start)

    def _compare(self, answer: Answer, gold: str) -> GradeStatus:
        worker = self._take()
        cfg = self.config
        request = (answer.text, answer.latex, gold, cfg.parse_timeout_s, cfg.verify_timeout_s)
        try:
            worker.send(request)
            status: GradeStatus = "correct" if worker.receive(cfg.deadline_s) else "incorrect"
        except TimeoutError:
            self._discard(worker)
            return "timeout"
        except (EOFError, OSError, ValueError):  # the worker died (e.g. out of memory)
            self._discard(worker)
            return "incorrect"
        self._give_back(worker)
        return status

    def _take(self) -> _Worker:
        with self._available:
            while True:
                if self._closed:
                    raise RuntimeError("MathGrader is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.config.workers:
                    self._count += 1
                    break
                self._available.wait()
        try:
            return self._start()
        except BaseException:
            with self._available:
                self._count -= 1
                self._available.notify()
            raise

    def _start(self) -> _Worker:
        worker = _Worker()
        # Startup (a fresh interpreter importing math-verify, ~1 s) is no grade's deadline.
        try:
            if worker.receive(STARTUP_TIMEOUT_S) == "ready":
                return worker
        except (TimeoutError, EOFError, ValueError):
            pass
        worker.kill()
        code = worker.proc.returncode
        raise RuntimeError(f"math-verify worker failed to start (exit code {code})")

    def _give_back(self, worker: _Worker) -> None:
        with self._available:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
            self._available.notify()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._available:
            self._count -= 1
            self._available.notify()

    def close(self) -> None:
        """Stop the idle workers; busy ones stop when their grade returns."""
        with self._available:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._available.notify_all()
        for worker in idle:
            worker.kill()


if __name__ == "__main__":
    worker_main()
