"""`megatron-fr train RECIPE --rehearse` (launch/rehearsal.py): the learner step rehearsed under
fake tensors agrees with the planner (launch/plan.py) within 10 % at the peak, and exactly on
the model state, for the flagship's real per-layer shapes (cut to one layer: every layer has
the same shapes) and for a small dense layout with two pipeline stages; the verdict's exit
status. The rehearsal against a real step: tests/distributed/test_rehearsal.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGSHIP = str(REPO / "examples" / "qwen3_30b_a3b_lag8.yaml")
PEAK = re.compile(r"rehearsal peak ([\d.]+) GiB, planner ([\d.]+) GiB")
STATE = ("weights", "gradients (fp32 buffers)", "optimizer (main + Adam)")


def rehearse(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_fr", "train", FLAGSHIP, "--rehearse", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)


def check_against_planner(stdout: str, ranks: int) -> None:
    """Every rank's table: the model state equal to the planner's, the peak within 10 %."""
    peaks = PEAK.findall(stdout)
    assert len(peaks) == ranks, stdout
    for rehearsed, planned in peaks:
        assert abs(float(rehearsed) - float(planned)) <= 0.10 * float(rehearsed), stdout
    for part in STATE:
        rows = re.findall(rf"  {re.escape(part)}\s+([\d.]+) GiB\s+([\d.]+) GiB", stdout)
        assert len(rows) == ranks and all(ours == theirs for ours, theirs in rows), (part, stdout)


def test_the_flagships_layer_rehearsed_in_its_own_world_matches_the_planner():
    """No --world-size: the recipe's cluster.learner_nodes x learner_ranks; the terms fake
    tensors cannot trace are stated and counted in both columns."""
    result = rehearse("--layers", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    world = "16 ranks (cluster.learner_nodes 2 x learner_ranks 8)"
    assert f"qwen3-30b-a3b (preset): 1 layers; {world}" in result.stdout
    check_against_planner(result.stdout, ranks=1)
    assert "verdict: fits 80 GiB less the 4 GiB reserve" in result.stdout
    stated = {
        "CUDA context + cuBLAS workspaces": 0.5625,  # 512 MiB + 2 x 32 MiB
        "NCCL buffers, 9 groups": 2.25,  # 256 MiB each
        "sync buckets (after step)": 1.16,  # 2 x the bf16 151,936 x 2,048 embedding
    }
    for name, gib in stated.items():
        row = re.search(rf"  {re.escape(name)}\s+([\d.]+) GiB\s+([\d.]+) GiB", result.stdout)
        assert row and row[1] == row[2] == f"{gib:.2f}", (name, result.stdout)
    assert "stated: NCCL buffers, 9 groups: 256 MiB a group" in result.stdout

    def rehearsed_row(part: str) -> float:
        return float(re.search(rf"  {re.escape(part)}\s+([\d.]+) GiB", result.stdout)[1])

    # the sync's buckets are a peak candidate beside the step's (one layer: they set it), the
    # other terms are added on top
    state = sum(rehearsed_row(part) for part in STATE)
    step = max(rehearsed_row("traced peak"), state + rehearsed_row("sync buckets (after step)"))
    rehearsed = float(PEAK.search(result.stdout)[1])
    assert rehearsed == pytest.approx(step + 0.5625 + 2.25, abs=0.03)


def test_a_small_dense_pipeline_rehearsed_per_stage_and_refused_when_over():
    layout = [
        "--world-size",
        "4",
        "--layers",
        "2",
        "--gpu-mem-gb",
        "6",
        "model.hf_dir=/models/Qwen3-8B",
        "parallel.tensor=2",
        "parallel.pipeline=2",
        "parallel.context=1",
        "parallel.expert=1",
        "learner.micro_batch_tokens=2048",
        "learner.recompute=none",
    ]
    result = rehearse(*layout)
    assert "qwen3-8b (preset): 2 layers; 4 ranks" in result.stdout, result.stderr[-3000:]
    assert "rank 0 (stage 0)" in result.stdout and "rank 2 (stage 1)" in result.stdout
    check_against_planner(result.stdout, ranks=2)
    # the last stage (embedding-sized output layer, the loss path) is over 6 GiB less 4
    assert "does NOT fit 6 GiB" in result.stdout and result.returncode == 3
