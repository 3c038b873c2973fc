"""Test tiers: `gpu` tests are skipped, with the reason shown, where CUDA is absent.

tests/ itself is put on sys.path so every tier can import the shared fixtures module
tiny_qwen (spawned ranks inherit the path). The test process is an entry point: it installs
the CPU shims megatron needs without CUDA (the tests that build megatron models in this
process), without the device mode, which only the ranks' schedules and optimizers need
(parallel/spawn.py's ranks install everything).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_fr.parallel.cpu_shims import install_cpu_shims

sys.path.insert(0, str(Path(__file__).parent))
install_cpu_shims(device_mode=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (this machine has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
