"""tools/gate_by_advantage.py: acceptance by advantage sign from batches.jsonl, counted by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.analysis.gate_report import gate_by_advantage_sign

REPO = Path(__file__).resolve().parents[2]
BATCHES = [
    # step 1: A = +0.5 +0.5 -0.5 -0.5; admitted: yes no yes yes
    {
        "step": 1,
        "advantages": [0.5, 0.5, -0.5, -0.5],
        "admitted": [True, False, True, True],
        "sequence_kl": [1e-3, 5e-3, 2e-3, 2.5e-3],
    },
    # step 2: A = +0.75 -0.25 -0.25 -0.25; admitted: no yes no no; A = 0 never happens here
    {
        "step": 2,
        "advantages": [0.75, -0.25, -0.25, -0.25],
        "admitted": [False, True, False, False],
        "sequence_kl": [4e-3, 1e-3, 9e-3, 3.5e-3],
    },
]


def test_counts_the_runs_own_decisions_by_sign():
    report = gate_by_advantage_sign(BATCHES)
    assert report.steps == 2
    assert report.positive == (1, 3)  # step 1: 1 of 2; step 2: 0 of 1
    assert report.negative == (3, 5)  # step 1: 2 of 2; step 2: 1 of 3
    assert report.admitted_per_step == pytest.approx((3 + 1) / 2)
    # step 1: (0.5 - 0.5 - 0.5) / 4; step 2: -0.25 / 4
    assert report.admitted_advantage == pytest.approx(((-0.5 / 4) + (-0.25 / 4)) / 2)


def test_a_delta_recomputes_admission_from_the_recorded_kl():
    report = gate_by_advantage_sign(BATCHES, delta=3e-3, from_step=2)
    assert report.steps == 1
    assert report.positive == (0, 1)  # 4e-3 > 3e-3
    assert report.negative == (1, 3)  # 1e-3 only
    assert report.admitted_advantage == pytest.approx(-0.25 / 4)


def test_the_tool_prints_a_row_per_run_and_refuses_runs_without_gate_fields(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "batches.jsonl").write_text("".join(json.dumps(b) + "\n" for b in BATCHES))
    old = tmp_path / "old"
    old.mkdir()
    (old / "batches.jsonl").write_text(json.dumps({"step": 1, "advantages": [0.1]}) + "\n")
    tool = [sys.executable, str(REPO / "tools" / "gate_by_advantage.py")]
    env = {"PYTHONPATH": str(REPO)}
    result = subprocess.run([*tool, str(run)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert f"| {run} | 2 | 0.333 (1/3) | 0.600 (3/5) | 2.0 | -0.0938 |" in result.stdout
    refused = subprocess.run([*tool, str(old)], capture_output=True, text=True, env=env)
    assert refused.returncode == 2 and "predates" in refused.stdout
    missing = subprocess.run([*tool, str(tmp_path)], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "no such file" in missing.stdout
