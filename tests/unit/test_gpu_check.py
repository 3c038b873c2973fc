"""tools/gpu_check.sh: its dry run on CPU (the plan, every Python part imports), the tiers'
skip reasons where the hardware is missing, the model FLOP count against a hand computation,
and on a GPU machine the whole check (shellcheck: tests/unit/test_slurm_launcher.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"
sys.path.insert(0, str(REPO / "tools"))

from gpu_check import SKIPPED, model_flops_per_token  # noqa: E402

from megatron_fr.models.hf_config import load_hf_config  # noqa: E402


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_dry_run_prints_both_tiers_and_imports_every_part():
    result = run("--dry-run")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "single tier:" in out and "cluster tier:" in out
    for step in ("parity", "throughput", "train", "sglang"):
        assert f"  {step}" in out
    assert "imports: 9 modules import" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip path without a GPU")
def test_without_a_gpu_each_tier_says_why_it_is_skipped(tmp_path):
    probe = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "probe",
                            "cluster"], capture_output=True, text=True)  # fmt: skip
    assert probe.returncode == SKIPPED
    assert "skipped: no CUDA device; 0 GPU(s), the cluster tier needs 2" in probe.stdout
    result = run("--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("skipped: no CUDA device") == 2


def test_model_flops_per_token_of_the_qwen3_30b_a3b_slice():
    spec = load_hf_config("qwen3-30b-a3b")
    h, q, kv, layers, vocab, seq = 2048, 32 * 128, 4 * 128, 48, 151936, 4096
    per_layer = h * (q + 2 * kv) + q * h + 8 * 3 * h * 768 + 128 * h  # attention, top-8, router
    expected = 6 * (layers * per_layer + vocab * h) + 6 * layers * seq * q
    assert model_flops_per_token(spec, seq) == expected
    # ~3.0 B parameters a token passes through (18.2 GFLOP) + attention at 4,096 tokens (4.8).
    assert 22.5e9 < expected < 23.5e9


@pytest.mark.gpu
def test_gpu_check_passes_on_this_gpu_machine(tmp_path):
    result = run("--out", str(tmp_path), timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "learner tokens/s" in result.stdout
