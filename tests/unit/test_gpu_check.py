"""tools/gpu_check.sh: its dry run on CPU (the plan, every Python part imports), the tiers'
skip reasons where the hardware is missing (a skipped tier is reported SKIPPED with its
reason, never as passed, and fails --require-all; the shell's bookkeeping checked with a
stand-in interpreter whose probes and steps answer as told), tools/bench_learner.py's model
FLOP count against a hand computation and its CPU run, and on a GPU machine the whole check
(shellcheck: tests/unit/test_slurm_launcher.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "tools"))

from bench_learner import model_flops, packed_lengths  # noqa: E402
from gpu_check import SKIPPED  # noqa: E402

from megatron_fr.models.hf_config import load_hf_config  # noqa: E402


def run(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_dry_run_prints_both_tiers_and_imports_every_part():
    result = run("--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "single tier:" in out and "cluster tier:" in out and "te tier:" in out
    assert "--skip-tokenizer-init" in out
    for step in ("parity", "bench", "train", "sglang"):
        assert f"  {step}" in out
    assert "imports: 10 modules import" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip path without a GPU")
def test_without_a_gpu_each_tier_says_why_it_is_skipped(tmp_path):
    probe = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_check.py"), "probe", "cluster"],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == SKIPPED
    assert "skipped: no CUDA device; 0 GPU(s), the cluster tier needs 2" in probe.stdout
    assert "transformer-engine" not in probe.stdout, "the cluster tier does not need TE"
    result = run("--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for tier in ("single", "cluster", "te"):
        assert f"SKIPPED: {tier} tier: no CUDA device" in result.stdout
    assert "passed" not in result.stdout
    assert "gpu_check: 3 tier(s) SKIPPED: they proved nothing on this machine" in result.stdout
    required = run("--out", str(tmp_path), "--require-all")
    assert required.returncode == SKIPPED
    assert "NOT COMPLETE: 3 tier(s) skipped and --require-all was given" in required.stdout


STAND_IN = """#!/usr/bin/env bash
# $1: tools/gpu_check.py, $2: the step, $3: a probe's tier
case "$2" in
    probe)
        case "$3" in
            single) echo "gpus: stand-in" ;;
            cluster) echo "gpus: stand-in"; echo "skipped: SGLang not installed"; exit 4 ;;
            te) echo "skipped: transformer-engine not installed"; exit 4 ;;
        esac ;;
    "$FAIL_STEP") echo "FAILED: as told"; exit 1 ;;
    *) echo "$2: ok" ;;
esac
"""


@pytest.mark.parametrize("fail_step", ["none", "train"])
def test_a_skipped_tier_is_never_reported_as_passed(tmp_path, fail_step):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = dict(os.environ, MFR_PYTHON=str(python), FAIL_STEP=fail_step)
    result = run("--out", str(tmp_path / "out"), env=env)
    out = result.stdout
    assert "SKIPPED: cluster tier: SGLang not installed" in out
    assert "SKIPPED: te tier: transformer-engine not installed" in out
    skipped = (
        "cluster SKIPPED (SGLang not installed); te SKIPPED (transformer-engine not installed)"
    )
    if fail_step == "none":
        assert f"gpu_check: single passed; {skipped}" in out
        assert result.returncode == 0, out
        assert "gpu_check: 2 tier(s) SKIPPED" in out
        required = run("--out", str(tmp_path / "out"), "--require-all", env=env)
        assert required.returncode == SKIPPED and "single passed" in required.stdout
    else:
        assert f"gpu_check: single FAILED; {skipped}" in out
        assert "gpu_check: FAILED: train" in out and result.returncode == 1


def test_model_flops_of_a_packed_qwen3_30b_a3b_slice():
    spec = load_hf_config("qwen3-30b-a3b")
    h, q, kv, layers, vocab = 2048, 32 * 128, 4 * 128, 48, 151936
    per_layer = h * (q + 2 * kv) + q * h + 8 * 3 * h * 768 + 128 * h  # attention, top-8, router
    lengths = [4097, 1025]  # 4,096 + 1,024 model tokens
    expected = 6 * 5120 * (layers * per_layer + vocab * h) + 6 * layers * q * (4096**2 + 1024**2)
    assert model_flops(spec, lengths) == expected
    # ~3.0 B parameters a token passes through (18.2 GFLOP) + attention (4.8 at 4,096 tokens)
    assert 22.5e9 < model_flops(spec, [4097]) / 4096 < 23.5e9
    packed = packed_lengths(16384, 2048, seed=0)
    assert sum(n - 1 for n in packed) == 16384 and min(packed) >= 2


def test_bench_learner_runs_on_cpu_and_reports_every_figure():
    """The tiny shape (2,048 tokens): every figure, and the loss path's extra memory at
    Qwen3's vocabulary at most a quarter of the micro-batch's fp32 logits."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "bench_learner.py"),
            "--spec",
            "torch",
            "--iterations",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for name in (
        "tokens/s",
        "model TFLOP/s",
        "peak memory",
        "time: attention",
        "time: experts with dispatch",
        "time: loss",
        "time: optimizer",
    ):
        assert name in out, out
    assert "spec                                   torch on cpu" in out
    ratio = float(out.split("loss path peak extra memory: ")[1].split()[0])
    assert 0 < ratio <= 0.25, out


@pytest.mark.gpu
def test_gpu_check_passes_on_this_gpu_machine(tmp_path):
    result = run("--out", str(tmp_path), timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "model TFLOP/s torch / local spec" in result.stdout
