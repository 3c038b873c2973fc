"""A rehearsal (launch/rehearsal.py: the learner step under fake tensors in a fake world) holds
what the real step holds: a small MoE at TP2 x EP2 x CP2 run for real on gloo ranks under
MemTracker, and rehearsed as rank 0 of the same world with the CPU's kernels, the real ones
here; equal model state, equal peaks within 5 %."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_qwen import TINY

from megatron_fr.parallel.spawn import run_on_ranks

RECIPE = "examples/qwen3_30b_a3b_lag8.yaml"
WORLD = 4  # TP2 x CP2; EP2 x ETP1 x EDP2 for the experts
# tiny hidden sizes, but rows long enough that activations weigh as much as the model state
CONFIG = dict(TINY["qwen3_moe"], hidden_size=128, max_position_embeddings=512)
OVERRIDES = [
    "parallel.tensor=2",
    "parallel.context=2",
    "parallel.expert=2",
    "parallel.expert_tensor=1",
    "learner.micro_batch_tokens=256",
    "buffer.batch_size=4",
    "buffer.capacity=36",
]


def real_step(rank: int, world_size: int, hf_dir: str) -> dict:
    import dataclasses

    from megatron_fr.config.run import load_run_config
    from megatron_fr.launch.rehearsal import measure_step
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    config = load_run_config(RECIPE, [f"model.hf_dir={hf_dir}", *OVERRIDES])
    state.initialize(config.parallel, seed=config.seed)
    spec = load_hf_config(Path(hf_dir) / "config.json")
    learner = Learner(spec, config.parallel, config.learner, total_steps=4, spec_kind="torch")
    return dataclasses.asdict(measure_step(config, learner))


REHEARSE = f"""
import dataclasses, json, sys
from pathlib import Path
from megatron_fr.parallel.cpu_shims import install_cpu_shims
install_cpu_shims()
from megatron_fr.config.run import load_run_config
from megatron_fr.launch.rehearsal import rehearse
from megatron_fr.models.hf_config import load_hf_config
config = load_run_config(sys.argv[1], sys.argv[3:])
spec = load_hf_config(Path(sys.argv[2]) / "config.json")
memory = rehearse(config, spec, world={WORLD}, rank=0, cpu_kernels=True, hf_dir=sys.argv[2])
print(json.dumps(dataclasses.asdict(memory)))
"""


def rehearsed_rank0(hf_dir: str) -> dict:
    """Rank 0's rehearsal with the CPU's kernels, in a process of its own (a fake world)."""
    command = [sys.executable, "-c", REHEARSE, RECIPE, hf_dir, f"model.hf_dir={hf_dir}"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    result = subprocess.run(command + OVERRIDES, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.distributed
def test_rehearsed_peak_is_the_real_one_at_tp2_ep2_cp2(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    hf_dir = tmp_path / "hf"
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG)).save_pretrained(hf_dir)
    assert json.loads((hf_dir / "config.json").read_text())["hidden_size"] == 128
    real = run_on_ranks(real_step, WORLD, str(hf_dir), timeout_s=600)[0]
    rehearsed = rehearsed_rank0(str(hf_dir))
    for part in ("weights", "grads", "optimizer"):  # the same tensors, fake or real
        assert rehearsed[part] == real[part], part
    assert abs(rehearsed["peak"] - real["peak"]) <= 0.05 * real["peak"], (rehearsed, real)
