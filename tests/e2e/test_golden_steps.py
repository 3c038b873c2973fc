"""Golden first steps: the first 10 optimizer steps of a CPU demo run, with seeded sampling
(rollout.seeded: each request's sampler seeded from the run's seed, the prompt id and the
turn), must reproduce the rewards, losses and gradient norms pinned in
tests/golden/cpu_demo_lag0.json, and at max_lag 2 (every batch from step 3 on exactly 2
versions old: buffer.fill_staleness_budget, which batches in admission order, so which
rollouts train together does not depend on timing) also the gate's mean KL and acceptance and
the batches' lags, pinned in tests/golden/cpu_demo_lag2.json. The whole chain is in them:
the demo model, the engine's sampling and log-probs, the buffer's prompt order, the
advantages, the FlashREINFORCE loss on 2 megatron ranks at EP2, the optimizer and the weight
broadcast (each step's rollouts are sampled from the weights the previous step sent).

Two runs of this command on one machine agree to about 1e-6 relative in the first steps (the
trajectories of a batch arrive in a different order and are summed in another), and the
difference grows with each optimizer step: one run of the whole suite on a busy machine had
step 8's gradient norm 1.2e-4 relative from the golden file's. Rewards are compared exactly,
losses and gradient norms within TOLERANCE. A change that moves them beyond that is a change
of numerics: if it is intended, regenerate the file with

    MEGATRON_FR_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/e2e/test_golden_steps.py

and say why in the commit. At lag 2 the ratios differ from 1 and the gate holds some out, so
a wrong ratio, gate or staleness accounting moves these numbers; acceptance and lags are
compared exactly.

The chain starts from the demo model, so the golden file also names its sha256 and the test
checks it first: a different model means the warm start changed, or the CPU kernels are not
the pinned ones (megatron_fr/utils/cpu_kernels.py: without the pin, another processor's
kernels round differently and every number here moves).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from training_runs import run_megatron_fr, step_rows, train_args

from megatron_fr.utils.cpu_kernels import PINNED
from megatron_fr.utils.provenance import weights_sha256

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
TOLERANCE = {"rel": 1e-3, "abs": 1e-6}
LAG0 = [
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
LAG2 = [
    *(s for s in LAG0 if not s.startswith(("buffer.max_lag", "buffer.capacity", "buffer.max_in"))),
    "buffer.max_lag=2",
    "buffer.fill_staleness_budget=true",
    "buffer.capacity=48",
    "buffer.max_in_flight=48",
]
RUNS = {  # golden file: (settings, pinned within TOLERANCE, pinned exactly)
    "cpu_demo_lag0.json": (LAG0, ("loss", "grad_norm"), ("reward_mean",)),
    "cpu_demo_lag2.json": (
        LAG2,
        ("loss", "grad_norm", "sequence_kl_mean"),
        ("reward_mean", "acceptance_rate", "lag_mean", "lag_max"),
    ),
}


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
@pytest.mark.parametrize("golden_name", list(RUNS))
def test_the_first_ten_steps_match_the_golden_file(
    tmp_path: Path, demo_model: Path, golden_name: str
) -> None:
    settings, approximate, exact = RUNS[golden_name]
    golden_file = GOLDEN / golden_name
    model_hash = weights_sha256(demo_model)
    updating = os.environ.get("MEGATRON_FR_UPDATE_GOLDEN") == "1"
    if not updating:
        golden = json.loads(golden_file.read_text())
        assert golden["settings"] == settings, "the golden file was made with other settings"
        assert model_hash == golden["demo_model_sha256"], (
            "another starting model: the demo warm start's numerics changed, or this process's "
            f"CPU kernels are not the pinned ones ({ {n: os.environ.get(n) for n in PINNED} })"
        )
    run_dir = tmp_path / "run"
    recipe = REPO / "examples/cpu_demo.yaml"
    model = f"model.hf_dir={demo_model}"
    run_megatron_fr(
        *train_args(recipe, run_dir, model, *settings, *prompt_files(tmp_path / "data"))
    )
    steps = step_rows(run_dir)
    measured = {key: [row[key] for row in steps] for key in (*exact, *approximate)}
    if updating:
        golden = {"settings": settings, "demo_model_sha256": model_hash, **measured}
        golden_file.write_text(json.dumps(golden, indent=1) + "\n")
    assert len(measured["loss"]) == 10
    assert any(loss != 0 for loss in golden["loss"]), "a golden run without learning signal"
    for key in exact:
        assert measured[key] == golden[key], key
    for key in approximate:
        assert measured[key] == pytest.approx(golden[key], **TOLERANCE), key
    if "buffer.max_lag=0" in settings:  # on-policy throughout (the lag-2 file pins its lags)
        assert [(row["lag_max"], row["lag_mean"]) for row in steps] == [(0, 0)] * 10
