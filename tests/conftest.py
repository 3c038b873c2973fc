"""Test tiers: `gpu` tests are skipped, with the reason shown, where CUDA is absent.

tests/ itself is put on sys.path so every tier can import the shared fixtures module
tiny_qwen (spawned ranks inherit the path). The test process is an entry point: it installs
the CPU shims megatron needs without CUDA (the tests that build megatron models in this
process), without the device mode, which only the ranks' schedules and optimizers need
(parallel/spawn.py's ranks install everything). It is also an entry point that computes, so
it pins the CPU kernels (megatron_fr/utils/cpu_kernels.py) as the `megatron-fr` command does:
the golden steps and demo models it makes are the same bits on every x86 machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_fr.demo.config import QUICK_DEMO_MODEL
from megatron_fr.parallel.cpu_shims import install_cpu_shims
from megatron_fr.utils.cpu_kernels import pin_cpu_kernels

sys.path.insert(0, str(Path(__file__).parent))
pin_cpu_kernels()  # before any tensor maths; spawned ranks and started commands inherit it
install_cpu_shims(device_mode=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU demo's tiny model (examples/cpu_demo.yaml), with a short warm start, made once
    per test session by `megatron-fr demo prepare`; tests pass it as model.hf_dir."""
    from megatron_fr.cli import main

    hf_dir = tmp_path_factory.mktemp("demo-model") / "cpu_demo"
    recipe = Path(__file__).parents[1] / "examples" / "cpu_demo.yaml"
    assert main(["demo", "prepare", str(recipe), f"model.hf_dir={hf_dir}", *QUICK_DEMO_MODEL]) == 0
    return hf_dir
