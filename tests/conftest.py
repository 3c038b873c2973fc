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

import hashlib
import os
import shutil
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


REPO = Path(__file__).parents[1]
DEMO_RECIPE = REPO / "examples" / "cpu_demo.yaml"


@pytest.fixture(scope="session")
def demo_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU demo's tiny model (examples/cpu_demo.yaml), with a short warm start, made by
    `megatron-fr demo prepare`; tests pass it as model.hf_dir and only read it. It is kept in
    pytest's cache under a key of everything that makes it (the recipe, the quick settings,
    the package's code and data, torch's and transformers' versions), so the test sessions of
    one checkout (the main suite, then the real-engine tiers) make it once: the warm start is
    seeded and the kernels pinned, so a model made again would be the same bits."""
    from megatron_fr.cli import main

    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    kept = cache.mkdir(f"demo-model-{demo_model_key()}") if cache is not None else None
    if kept is not None and (kept / "cpu_demo" / "warm_start.json").is_file():
        return kept / "cpu_demo"
    hf_dir = tmp_path_factory.mktemp("demo-model") / "cpu_demo"
    prepare = ["demo", "prepare", str(DEMO_RECIPE), f"model.hf_dir={hf_dir}", *QUICK_DEMO_MODEL]
    assert main(prepare) == 0
    if kept is None:
        return hf_dir
    staged = kept / f"staged-{os.getpid()}"
    shutil.copytree(hf_dir, staged)
    try:
        os.replace(staged, kept / "cpu_demo")  # whole or not at all
    except OSError:  # a test session beside this one kept it first: the same bits
        shutil.rmtree(staged)
        if not (kept / "cpu_demo" / "warm_start.json").is_file():
            raise
    return kept / "cpu_demo"


def demo_model_key() -> str:
    """A digest of what the demo model is made from: a change to any of it makes another."""
    import transformers

    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    digest.update(repr(QUICK_DEMO_MODEL).encode())
    sources = [DEMO_RECIPE, *sorted((REPO / "megatron_fr").rglob("*.py"))]
    sources += sorted((REPO / "examples" / "data" / "cpu_math").rglob("*"))
    for path in sources:
        if path.is_file():
            digest.update(str(path.relative_to(REPO)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]
