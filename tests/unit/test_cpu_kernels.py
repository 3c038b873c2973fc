"""The CPU kernels pinned to AVX2 (megatron_fr/utils/cpu_kernels.py): what pin_cpu_kernels
sets, what it leaves to the user, and that an entry point's pin (the `megatron-fr` command's,
the test session's) really selects ATen's AVX2 kernels in a fresh interpreter. That the
pinned kernels give the same bits on another machine is what tests/e2e/test_golden_steps.py
checks wherever the suite runs: its golden files name the demo model's sha256 made on the
machine that wrote them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.utils.cpu_kernels import OPT_OUT, has_avx2, pin_cpu_kernels

REPO = Path(__file__).resolve().parents[2]


def test_the_unset_variables_are_set_to_the_avx2_paths() -> None:
    environ: dict[str, str] = {}
    added = pin_cpu_kernels(environ, avx2=True)
    assert environ == {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "avx2"} == added


def test_a_variable_the_user_set_is_kept() -> None:
    environ = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert pin_cpu_kernels(environ, avx2=True) == {"MKL_CBWR": "COMPATIBLE,STRICT"}
    assert environ["ATEN_CPU_CAPABILITY"] == "avx512"


def test_nothing_is_set_when_opted_out_or_without_avx2() -> None:
    opted_out = {OPT_OUT: "1"}
    assert pin_cpu_kernels(opted_out, avx2=True) == {} and opted_out == {OPT_OUT: "1"}
    without: dict[str, str] = {}
    assert pin_cpu_kernels(without, avx2=False) == {} and without == {}


def test_avx2_is_read_from_the_flags_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert has_avx2(cpuinfo)
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx512f\n")
    assert not has_avx2(cpuinfo)
    assert not has_avx2(tmp_path / "missing")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    cpuinfo.write_text("flags\t\t: avx2\n")
    assert not has_avx2(cpuinfo)


MKL_QUERY = """
import ctypes, os, torch
from megatron_fr.utils.cpu_kernels import pin_cpu_kernels
pin_cpu_kernels()  # as the entry points do, before any tensor maths
torch.ones(4, 4) @ torch.ones(4, 4)  # MKL and ATen now fixed on their kernels
mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
print(torch.backends.cpu.get_cpu_capability(), hex(mkl.mkl_serv_cbwr_get(-1)))
"""
"""Prints ATen's kernel capability and MKL's reproducibility mode (mkl_cbwr_get of all its
settings: the branch, 3 for compatible, with 0x10000 for strict; 0x1 when off) in a fresh
interpreter that imports torch before it pins, as the `megatron-fr` command may."""


def kernels_chosen(extra_env: dict[str, str]) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    result = subprocess.run(
        [sys.executable, "-c", MKL_QUERY],
        capture_output=True,
        text=True,
        check=True,
        env=env | {"PYTHONPATH": str(REPO)} | extra_env,
    )
    aten, mkl = result.stdout.split()
    return aten, mkl


def mkl_is_queryable() -> bool:
    """torch's CPU wheels for x86 link MKL into libtorch_cpu and export its service calls."""
    import ctypes

    import torch

    try:
        ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))[
            "mkl_serv_cbwr_get"
        ]
    except (OSError, AttributeError):
        return False
    return True


@pytest.mark.skipif(not has_avx2(), reason="the pin applies to x86 processors with AVX2 only")
@pytest.mark.skipif(not mkl_is_queryable(), reason="this torch build does not export MKL's calls")
def test_the_pin_fixes_both_libraries_kernels_unless_the_user_chose() -> None:
    assert kernels_chosen({}) == ("AVX2", "0x10003")
    assert kernels_chosen({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"}) == (
        "DEFAULT",
        "0x2",
    )
    assert kernels_chosen({OPT_OUT: "1"})[1] == "0x1"
