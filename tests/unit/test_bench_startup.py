"""tools/bench_startup.py measures the first step on the test suite's quick demo model when
no model is given: the same overrides as tests/conftest.py's, so both make the same model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from conftest import QUICK_DEMO_MODEL

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_startup.py"


def test_the_benchmark_makes_the_suites_quick_demo_model() -> None:
    spec = importlib.util.spec_from_file_location("bench_startup", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.QUICK_DEMO_MODEL == QUICK_DEMO_MODEL
    assert module._is_step('{"step": 1, "reward_mean": 0.5}')
    assert not module._is_step('{"step": 0, "eval_accuracy": 0.4}')
    assert not module._is_step('{"step": 1, "rew')  # a line being written
