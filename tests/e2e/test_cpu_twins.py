"""The CPU twins of the paper recipes run through the real chain (2 megatron ranks at EP2, the
CPU engine, the weight broadcast, the environments, the agent loop) for 3 optimizer steps
each; for the multi-turn tasks the episodes must run several turns, the environment's tokens
must carry no gradient (action mask 0, no log-prob, no version), and the environment's
reward must be the one the loss was given (the advantages in batches.jsonl are the rewards
less the batch mean, FlashREINFORCE's baseline written out here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_runs import records, run_megatron_fr, step_rows, train_args

from megatron_fr.buffer.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
TWINS = ["cpu_python_tool", "cpu_alfworld", "cpu_textworld"]


SCORED_PROBLEMS = "2"
"""Problems scored by the warm start and by the run's evaluations: the test asserts nothing of
either score, and each is a multi-turn episode (the warm start's weights do not depend on it:
it scores after training)."""


def run_twin(name: str, run_dir: Path, *overrides: str) -> None:
    """`demo prepare` (the twin's tiny model, in the run's directory) then `train`."""
    from megatron_fr.demo.config import DEFAULTS

    recipe = REPO / "examples" / f"{name}.yaml"
    model = f"model.hf_dir={run_dir.parent / 'model'}"
    demo = []
    if name.removeprefix("cpu_") in DEFAULTS:  # warm-started: python_tool
        demo = [f"demo.warm_start.eval_problems={SCORED_PROBLEMS}"]
    run_megatron_fr("demo", "prepare", str(recipe), model, *demo, timeout_s=1500)
    scored = f"eval.problems={SCORED_PROBLEMS}"
    run_megatron_fr(*train_args(recipe, run_dir, model, scored, *overrides), timeout_s=1500)


def queued_trajectories(run_dir: Path) -> list[Trajectory]:
    """The trajectories still queued at the last checkpoint (the buffer's own copies)."""
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((run_dir / "checkpoints" / latest / "controller.json").read_text())
    return [
        Trajectory.from_dict(t) for group in state["rollout"]["buffer"]["queued"] for t in group
    ]


def environment_reward(steps: list[dict]) -> float:
    """What the environment's last step said: the grade of the final answer (python_tool),
    or whether the game was won (ALFWorld, TextWorld); 0 when the episode hit a limit."""
    last = steps[-1] if steps else {}
    return float(last.get("grade") == "correct" or bool(last.get("won")))


@pytest.mark.distributed
@pytest.mark.parametrize("name", TWINS)
def test_twin_trains_three_steps_multi_turn_with_the_environments_reward(tmp_path, name):
    run_dir = tmp_path / name
    run_twin(name, run_dir, "buffer.capacity=16")  # room for trajectories left queued
    steps = step_rows(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["turns_mean"] > 1 for r in steps), "episodes must run several turns"
    if name == "cpu_python_tool":
        assert sum(r["tool_calls_mean"] for r in steps) > 0, "the warm-started model calls"
    for batch in records(run_dir, "batches.jsonl"):
        mean = sum(batch["rewards"]) / len(batch["rewards"])
        expected = [reward - mean for reward in batch["rewards"]]
        assert batch["advantages"] == pytest.approx(expected, abs=1e-6)
    rows = queued_trajectories(run_dir)
    assert rows, "no trajectory left queued to inspect"
    for row in rows:
        mask, logprobs, versions = row.action_mask, row.behavior_log_probs, row.token_versions
        context = [i for i, policy in enumerate(mask) if not policy]
        assert all(logprobs[i] == 0.0 and versions[i] == -1 for i in context)
        assert row.reward == environment_reward(row.info["steps"])
        turns = row.info["turns"]
        spans = sum(1 for i in range(1, len(mask)) if mask[i] and not mask[i - 1])
        assert spans == turns, "one policy span per turn, observations between them"
