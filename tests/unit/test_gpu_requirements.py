"""The GPU requirements set resolves as one environment on its platform (pip, wheel metadata
only: tools/check_gpu_requirements.py), with sglang's own pins met; the consistency check
itself on hand-made resolutions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

from check_gpu_requirements import OFFLINE, inconsistencies, pinned  # noqa: E402


def test_pins_and_sglangs_own_pins_are_checked(tmp_path):
    requirements = tmp_path / "r.txt"
    requirements.write_text(
        "# c\ntorch==2.14.1\nsglang==0.5.23  # x\nnumpy>=1.26\nte[pytorch]==2.2\n"
    )
    assert pinned(requirements) == {"torch": "2.14.1", "sglang": "0.5.23", "te": "2.2"}
    conditional = "av==16.1.0; sys_platform == 'darwin'"  # not checked: it has a marker
    sglang = {
        "version": "0.5.23",
        "requires_dist": ["torch==2.14.1", "transformers==5.19.0", conditional],
    }
    resolved = {
        "sglang": sglang,
        "torch": {"version": "2.14.1"},
        "transformers": {"version": "5.19.0"},
        "te": {"version": "2.2"},
    }
    assert inconsistencies(resolved, pinned(requirements)) == []
    resolved["transformers"] = {"version": "5.24.0"}
    resolved["torch"] = {"version": "2.13.0"}
    assert inconsistencies(resolved, pinned(requirements)) == [
        "torch==2.14.1 pinned, resolved 2.13.0",
        "sglang requires torch==2.14.1, resolved 2.13.0",
        "sglang requires transformers==5.19.0, resolved 5.24.0",
    ]


def test_the_gpu_set_resolves_together_on_its_platform():
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_gpu_requirements.py")],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if result.returncode == OFFLINE:
        pytest.skip(f"the package index is not reachable from here: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    assert "torch 2.14.1, sglang 0.5.23, transformers 5.19.0, megatron-core 0.19.2" in result.stdout
