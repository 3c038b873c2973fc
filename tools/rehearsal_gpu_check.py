#!/usr/bin/env python
"""The rehearsal (launch/rehearsal.py) against a GPU, torchtitan's tracker-accuracy check: one
learner step of a one-GPU layout measured with torch.cuda.max_memory_allocated, and the same
step rehearsed under fake tensors (`megatron-fr train RECIPE --rehearse`, in a process of its
own); prints both peaks and their ratio.

    python tools/rehearsal_gpu_check.py [--recipe R] [--layers 2] [--tolerance 0.10]
        [key=value ...]

The layout is the recipe's at TP = CP = EP = 1 on one GPU, the model cut to --layers (the
flagship's Qwen3-30B-A3B at 2 layers holds about 34 GB of model state). Exit status 0 when
the peaks agree within --tolerance, 1 when not, 77 (skipped) without CUDA: nothing is
measured on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIPPED = 77
ONE_GPU = [
    "parallel.tensor=1",
    "parallel.context=1",
    "parallel.expert=1",
    "parallel.expert_tensor=1",
    "parallel.sequence_parallel=false",
    "learner.micro_batch_tokens=4096",
]


def measured_peak(recipe: str, layers: int, overrides: list[str]) -> int:
    """The step's peak on this GPU (bytes), the step of launch/rehearsal.py's measure_step."""
    import torch

    from megatron_fr.config.run import load_run_config
    from megatron_fr.launch.rehearsal import worst_case_step
    from megatron_fr.launch.rehearse_cli import model_spec
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.parallel.state import initialize_single_process

    config = load_run_config(recipe, overrides)
    initialize_single_process(config.parallel, seed=config.seed)
    spec, _ = model_spec(config, layers)
    learner = Learner(
        spec, config.parallel, config.learner, total_steps=2, spec_kind=config.model.spec
    )
    learner.model.zero_grad_buffer()
    learner.optimizer.step()  # the Adam state, as the rehearsal makes it
    step, rows = worst_case_step(config, learner)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    learner.accumulate_gradients(step, rows)
    learner.optimizer.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def rehearsed_peak(recipe: str, layers: int, overrides: list[str]) -> float:
    """The rehearsal's peak (GiB) of the same step, from the command's output."""
    command = [sys.executable, "-m", "megatron_fr", "train", recipe, "--rehearse"]
    command += ["--world-size", "1", "--layers", str(layers), *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    found = re.search(r"rehearsal peak ([\d.]+) GiB", result.stdout)
    if found is None:
        raise RuntimeError(f"the rehearsal printed no peak:\n{result.stdout}\n{result.stderr}")
    return float(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(REPO / "examples" / "qwen3_30b_a3b_lag8.yaml"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for the recipe")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("rehearsal_gpu_check: skipped (no CUDA device)")
        return SKIPPED
    overrides = [*ONE_GPU, *args.overrides]
    rehearsed = rehearsed_peak(args.recipe, args.layers, overrides)
    measured = measured_peak(args.recipe, args.layers, overrides) / 2**30
    ratio = rehearsed / measured
    print(
        f"rehearsal peak {rehearsed:.2f} GiB, torch.cuda.max_memory_allocated "
        f"{measured:.2f} GiB, ratio {ratio:.3f} ({torch.cuda.get_device_name()})"
    )
    return 0 if abs(ratio - 1) <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
