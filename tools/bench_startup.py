"""How long `megatron-fr` makes a user wait before it does anything, against `import torch`
measured in the same run, so that the ratios compare across machines of different speeds:

    .venv/bin/python tools/bench_startup.py [--hf-dir DEMO_MODEL] [--repeat 3]
    startup: --help X s, --check Y s, first step Z s; import torch T s

    import torch   `python -c "import torch"`
    --help         `megatron-fr --help`
    --check        `megatron-fr train examples/cpu_demo.yaml --check`
    first step     `megatron-fr train examples/cpu_demo.yaml --run-dir TMP steps=1` (a tiny
                   evaluation, no periodic one): from the command's start to its first step
                   line in metrics.jsonl, so the recipe check, torchrun, the ranks' imports,
                   megatron's set-up, the engine's start, the step-0 evaluation and the step
                   itself; the run is then left to finish (and waited for)

Each of the first three is the median of --repeat fresh processes, taken in turns, so that a
machine whose load changes during the run weighs on all of them alike; the first step is
measured once. Every command runs in a process of its own, as a user's would: nothing is
cached between them but what the operating system caches.

The demo's model: --hf-dir, else the recipe's model.hf_dir when `demo prepare` has made it,
else the test suite's quick demo model (megatron_fr.demo.config.QUICK_DEMO_MODEL) made
in a temporary directory first (minutes; not timed). Which model it is does not change the
start-up measured: the quick one has the demo's shapes, only a shorter warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_fr.demo.config import QUICK_DEMO_MODEL

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
ONE_STEP = [
    "steps=1",
    "eval.problems=4",
    "eval.samples=1",
    "eval.every_steps=0",
    "checkpoint.every_steps=100",
]
"""A 1-step run whose evaluations (the first and the last) are 4 problems, once each."""


def megatron_fr(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_fr", *args]


def wall_s(command: Sequence[str]) -> float:
    """Seconds `command` took, from its start to its exit; RuntimeError if it failed."""
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr}")
    return seconds


def first_step_s(hf_dir: Path, timeout_s: float, console: Path | None) -> float:
    """Seconds from the 1-step run's start to its first step line in metrics.jsonl; the run
    is then waited for (stopped, with its process group, if it exceeds `timeout_s`)."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as scratch:
        run_dir = Path(scratch) / "run"
        command = megatron_fr(
            "train", str(RECIPE), "--run-dir", str(run_dir), f"model.hf_dir={hf_dir}", *ONE_STEP
        )
        log = (console or Path(scratch) / "console.txt").open("w")
        started = time.perf_counter()
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            seconds = _wait_for_step(run_dir / "metrics.jsonl", process, started, timeout_s)
            process.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - started)))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait()
            log.close()
        if process.returncode != 0:
            raise RuntimeError(f"the 1-step run exited {process.returncode} (console: {log.name})")
        return seconds


def _wait_for_step(
    path: Path, process: subprocess.Popen, started: float, timeout_s: float
) -> float:
    while time.perf_counter() - started < timeout_s:
        if path.is_file() and any(_is_step(line) for line in path.read_text().splitlines()):
            return time.perf_counter() - started
        if process.poll() is not None:
            raise RuntimeError(f"the 1-step run exited {process.returncode} before its first step")
        time.sleep(0.1)
    raise RuntimeError(f"no step within {timeout_s:.0f} s")


def _is_step(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # a line being written
    return "eval_accuracy" not in record and "eval_incomplete" not in record


def demo_model(hf_dir: Path | None, scratch: Path) -> Path:
    """--hf-dir, the recipe's made model, or the quick demo model made in `scratch`."""
    if hf_dir is not None:
        return hf_dir
    made = (RECIPE.parent / "../runs/models/cpu_demo").resolve()
    if (made / "config.json").is_file():
        return made
    quick = scratch / "cpu_demo"
    print(f"bench_startup: making the quick demo model in {quick} (not timed)", file=sys.stderr)
    prepare = megatron_fr("demo", "prepare", str(RECIPE), f"model.hf_dir={quick}")
    subprocess.run([*prepare, *QUICK_DEMO_MODEL], cwd=REPO, check=True, capture_output=True)
    return quick


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", type=Path, help="the demo's model (default: see above)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the quick commands")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the 1-step run's limit")
    parser.add_argument("--console", type=Path, help="keep the 1-step run's console here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-model-") as scratch:
        hf_dir = demo_model(args.hf_dir, Path(scratch))
        commands = {
            "torch": [sys.executable, "-c", "import torch"],
            "help": megatron_fr("--help"),
            "check": megatron_fr("train", str(RECIPE), "--check", f"model.hf_dir={hf_dir}"),
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeat):
            for name, command in commands.items():
                times[name].append(wall_s(command))
        step = first_step_s(hf_dir, args.timeout_s, args.console)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"startup: --help {median['help']:.2f} s, --check {median['check']:.2f} s, "
        f"first step {step:.1f} s; import torch {median['torch']:.2f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
