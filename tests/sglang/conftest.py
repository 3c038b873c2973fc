"""The real-SGLang tier: SGLang 0.5.23 itself on CPU (.venv-sglang, tools/setup_sglang_cpu.sh),
started once per session by the project's launcher and shared by the tier's tests (a start
takes 25 s to several minutes on a 2-core machine).

A machine without .venv-sglang skips the tier with that reason; with
MEGATRON_FR_REQUIRE_SGLANG=1 (what tools/run_tests.sh sets once it has installed SGLang, so CI)
the same reason fails every test here, so the tier cannot be skipped silently. The tiny dense
Qwen3 and prompt are the vLLM tier's (tests/vllm/vllm_servers.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parents[1] / "vllm"))  # its vllm_servers only
from vllm_servers import TINY_QWEN3

from megatron_fr.engine.launcher import (
    ServerExited,
    ServerLaunchConfig,
    ServerProcess,
    launch_server,
)
from megatron_fr.engine.sglang import launch as sglang_launch
from megatron_fr.utils.net import free_port

REQUIRE_VARIABLE = "MEGATRON_FR_REQUIRE_SGLANG"


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The interpreter of SGLang's CPU environment; skip (or fail) without one."""
    python = sglang_launch.cpu_interpreter(None)
    problem = sglang_launch.cpu_problem(python)
    if problem is None and python is not None:
        return python
    reason = f"real SGLang cannot run here: {problem}"
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


def start_sglang(model_dir: Path, log_dir: Path, attempts: int = 3) -> ServerProcess:
    """The server, healthy; started again on another port when the one picked was taken in
    the seconds SGLang spends importing before it binds."""
    for attempt in range(attempts):
        config = ServerLaunchConfig(model_path=str(model_dir), port=free_port(), log_dir=log_dir)
        server = launch_server(config)
        try:
            server.wait_healthy(deadline_s=900)
            return server
        except ServerExited as error:
            server.stop()
            if "Address already in use" not in str(error) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def sglang_server(sglang_python, tmp_path_factory):
    """(url, the transformers model it serves): one server for the whole tier."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sglang")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**TINY_QWEN3))
    model.save_pretrained(root / "hf")
    server = start_sglang(root / "hf", root)
    try:
        yield server.url, model.eval()
    finally:
        server.stop()
