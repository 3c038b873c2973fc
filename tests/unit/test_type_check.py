"""The package type-checks clean: mypy, run as the test command's own step, under the
configuration in pyproject.toml ([tool.mypy]: every function annotated, every body checked,
untyped third-party packages named one by one). Judged by mypy's exit code and its summary
line, which must also count every module of the package, so a configuration that silently
checks less (a narrowed `files`, an excluded folder) fails here too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.typecheck
def test_package_type_checks_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-8000:]
    summary = re.search(r"^Success: no issues found in (\d+) source files?$", report, re.M)
    assert summary is not None, report[-2000:]
    modules = sum(1 for _ in (REPO / "megatron_fr").rglob("*.py"))
    assert int(summary.group(1)) == modules, f"mypy checked {summary.group(1)} of {modules}"
