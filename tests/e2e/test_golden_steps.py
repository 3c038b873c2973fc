"""Golden first steps: the first 10 optimizer steps of a lag-0 CPU demo run, with seeded
sampling (rollout.seeded: each request's sampler seeded from the run's seed, the prompt id and
the turn), must reproduce the rewards, losses and gradient norms pinned in
tests/golden/cpu_demo_lag0.json. The whole chain is in them: the demo model, the engine's
sampling and log-probs, the buffer's prompt order, the advantages, the FlashREINFORCE loss on
2 megatron ranks at EP2, the optimizer and the weight broadcast (each step's rollouts are
sampled from the weights the previous step sent).

Two runs of this command on one machine agree to about 1e-6 relative (the trajectories of a
batch arrive in a different order and are summed in another); rewards are compared exactly,
losses and gradient norms within TOLERANCE. A change that moves them beyond that is a change
of numerics: if it is intended, regenerate the file with

    MEGATRON_FR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/e2e/test_golden_steps.py

and say why in the commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "cpu_demo_lag0.json"
TOLERANCE = {"rel": 1e-4, "abs": 1e-6}
SETTINGS = [
    "steps=10",
    "seed=0",
    "buffer.max_lag=0",
    "buffer.batch_size=16",
    "buffer.capacity=16",
    "buffer.max_in_flight=16",
    "eval.problems=4",
    "eval.samples=1",
    "eval.every_steps=0",
    "rollout.seeded=true",
    "checkpoint.every_steps=100",
]


def prompt_files(directory: Path) -> list[str]:
    """Every one-digit sum of the train split once, and 8 held-out ones (the demo model of
    tests/conftest.py is warm-started on one-digit sums)."""
    from megatron_fr.demo.arithmetic import ArithmeticConfig, ArithmeticProblems
    from megatron_fr.demo.text_math import TextMathConfig, write_rows

    config = TextMathConfig(problems=ArithmeticConfig(digits=1))
    size = ArithmeticProblems(config.problems).split_size("train")
    directory.mkdir(parents=True, exist_ok=True)
    train = write_rows(directory / "train.jsonl", config, "train", size, seed=0)
    held_out = write_rows(directory / "eval.jsonl", config, "eval", 8, seed=0)
    return [f"task.train.path={train}", f"task.eval_sets.heldout.path={held_out}"]


@pytest.mark.distributed
def test_the_first_ten_steps_match_the_golden_file(tmp_path: Path, demo_model: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "megatron_fr",
        "train",
        str(REPO / "examples/cpu_demo.yaml"),
        "--run-dir",
        str(run_dir),
        f"model.hf_dir={demo_model}",
        *SETTINGS,
        *prompt_files(tmp_path / "data"),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in steps if "reward_mean" in row]
    measured = {key: [row[key] for row in steps] for key in ("reward_mean", "loss", "grad_norm")}
    if os.environ.get("MEGATRON_FR_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"settings": SETTINGS, **measured}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["settings"] == SETTINGS, "the golden file was made with other settings"
    assert len(measured["loss"]) == 10
    assert measured["reward_mean"] == golden["reward_mean"]
    assert any(loss != 0 for loss in golden["loss"]), "a golden run without learning signal"
    for key in ("loss", "grad_norm"):
        assert measured[key] == pytest.approx(golden[key], **TOLERANCE), key
