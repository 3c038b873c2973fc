"""The fuzz-and-fault suite's common part: a case, how it is run, and how its outcome is judged.

A case is a command line (and, for some, files or an environment made for it) with what it
must do: be refused with an error that names `names` (a key, file or field), or succeed. Each
is run in this process through the command's own main() with stderr captured, unless it needs
a process of its own (an environment of launcher variables). Its outcome is one of

    clear      refused: non-zero exit, no traceback, exactly one error line, naming what it
               must name
    vague      refused without a traceback, but the error does not name what it must
    noisy      refused without a traceback, but in more than one error line
    traceback  an exception escaped main(), or a traceback was printed
    hang       no answer within the case's deadline
    silent     a bad input was accepted (exit 0, or the command went on to start processes)
    deleted    a file of the case's `watch` directory is gone afterwards (moved is fine)
    ok         a good input was accepted
    refused    a good input was refused

and a surface's test prints the counts and fails on any traceback, hang, silent acceptance or
refused good input, and below 98% clear among the bad inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAILURES = ("traceback", "hang", "silent", "deleted", "refused")
ERROR_LINE = re.compile(r"error|cannot", re.IGNORECASE)
"""A line that says what is wrong ("error: ...", "checkpoint ... cannot be resumed from")."""


class Started(Exception):
    """Raised where the command would start processes: it accepted its input."""


@dataclass
class Case:
    name: str
    argv: list[str]
    names: str | None
    """What the error must name; None: a good input, which must succeed."""
    env: dict[str, str] | None = None
    """Run in a process of its own with these variables added (launcher variables)."""
    deadline_s: float = 60.0
    prepare: Callable[[], object] | None = field(default=None, repr=False)
    """Makes the files the case needs, just before it runs."""
    watch: Path | None = None
    """A directory whose files must all still be there afterwards, wherever moved."""
    one_line: bool = True
    """A refusal must be exactly one error line (False: the surface has not been held to it)."""


@dataclass
class Result:
    case: Case
    outcome: str
    output: str


def _in_process(main: Callable[[list[str]], int], argv: list[str], deadline_s: float):
    """(exit code or None for a hang, captured stderr + stdout, the escaped exception text)."""
    box: dict = {}
    stream = io.StringIO()

    def call() -> None:
        try:
            box["code"] = main(argv)
        except Started:
            box["code"] = "started"
        except SystemExit as exit_:
            box["code"] = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # what escapes is what this suite counts
            box["raised"] = traceback.format_exc()

    with contextlib.redirect_stderr(stream), contextlib.redirect_stdout(stream):
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(deadline_s)
    if worker.is_alive():
        return None, stream.getvalue(), None
    return box.get("code"), stream.getvalue(), box.get("raised")


def _in_a_process(argv: list[str], env: dict[str, str], deadline_s: float):
    command = [sys.executable, "-m", "megatron_fr", *argv]
    variables = os.environ | {"PYTHONPATH": str(REPO)} | env
    try:
        done = subprocess.run(
            command,
            env=variables,
            capture_output=True,
            text=True,
            timeout=deadline_s,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as expired:
        return None, str(expired.stderr or ""), None
    return done.returncode, done.stderr + done.stdout, None


def judge(case: Case, code, output: str, raised: str | None) -> str:
    if raised is not None or "Traceback (most recent call last)" in output:
        return "traceback"
    if code is None:
        return "hang"
    accepted = code in (0, "started")
    if case.names is None:
        return "ok" if accepted else "refused"
    if accepted:
        return "silent"
    errors = [line for line in output.splitlines() if ERROR_LINE.search(line)]
    named = any(case.names.lower() in line.lower() for line in errors)
    if not named:
        return "vague"
    return "noisy" if case.one_line and len(errors) > 1 else "clear"


REWRITTEN = {("checkpoints", "latest")}
"""(folder, name) of files a command rewrites by design: a run's checkpoint pointer, which a
resume makes name the checkpoint it chose (what it said before is printed)."""


def contents(directory: Path | None) -> Counter:
    """What `directory` holds, as a multiset of each regular file's hash and each symlink's
    target, wherever under it they are (so a move is no loss), but for REWRITTEN files."""
    found: Counter = Counter()
    if directory is None or not directory.is_dir():
        return found
    for root, dirs, files in os.walk(directory):
        for name in [*files, *(d for d in dirs if os.path.islink(os.path.join(root, d)))]:
            path = os.path.join(root, name)
            if (os.path.basename(root), name) in REWRITTEN:
                continue
            if os.path.islink(path):
                found["link", os.readlink(path)] += 1
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    found["file", hashlib.blake2b(handle.read(), digest_size=16).hexdigest()] += 1
    return found


def run_case(case: Case, main: Callable[[list[str]], int]) -> Result:
    if case.prepare is not None:
        case.prepare()
    before = contents(case.watch)
    if case.env is not None:
        code, output, raised = _in_a_process(case.argv, case.env, case.deadline_s)
    else:
        code, output, raised = _in_process(main, case.argv, case.deadline_s)
    outcome = judge(case, code, output, raised)
    lost = before - contents(case.watch)
    if lost and outcome not in ("traceback", "hang"):
        outcome, output = "deleted", f"{output}\nlost: {sorted(lost)[:4]}"
    return Result(case, outcome, raised or output)


def report(surface: str, seed: int, results: list[Result]) -> Counter:
    """Print the counts (and every failure with its output's tail); return the counts."""
    counts = Counter(result.outcome for result in results)
    order = ["clear", "vague", "noisy", "traceback", "hang", "silent", "deleted", "ok", "refused"]
    summary = ", ".join(f"{outcome} {counts[outcome]}" for outcome in order)
    print(f"\nfuzz {surface} (seed {seed}): {len(results)} cases: {summary}")
    for result in results:
        if result.outcome in (*FAILURES, "vague", "noisy"):
            tail = result.output.strip().splitlines()[-6:]
            print(
                f"  {result.outcome}: {result.case.name}: {result.case.argv}\n    "
                + "\n    ".join(tail)
            )
    return counts


def assert_sound(counts: Counter) -> None:
    failures = {outcome: counts[outcome] for outcome in FAILURES if counts[outcome]}
    assert not failures, f"failures: {failures} (details printed above)"
    bad = counts["clear"] + counts["vague"] + counts["noisy"]
    assert counts["clear"] >= 0.98 * bad, f"only {counts['clear']} of {bad} bad inputs clear"
