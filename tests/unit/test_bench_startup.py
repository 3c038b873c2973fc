"""tools/bench_startup.py reads a run's first step from its metrics.jsonl: a step line, not an
evaluation's, and never a line still being written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_startup.py"


def test_the_benchmark_counts_a_step_line_only() -> None:
    spec = importlib.util.spec_from_file_location("bench_startup", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._is_step('{"step": 1, "reward_mean": 0.5}')
    assert not module._is_step('{"step": 0, "eval_accuracy": 0.4}')
    assert not module._is_step('{"step": 1, "rew')  # a line being written
