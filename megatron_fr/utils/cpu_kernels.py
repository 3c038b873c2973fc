"""CPU math kernels pinned to one code path each, so a CPU run computes the same bits on every
x86 machine.

torch picks its kernels by what the processor offers: ATen's vectorised kernels (softmax,
reductions, element-wise ops) and MKL's BLAS and vector maths each have AVX2 and AVX-512 code
paths, and on a processor from another vendor MKL takes yet another. They round differently,
so the same seeded demo warm start or training step gives different bits on two machines,
and sampled rollouts, which follow the bits, soon differ entirely: a golden test pinned on
one machine fails on another, and a comparison continued on another machine would mix two
starting models. Measured on one AMD EPYC (AVX2, no AVX-512): the quick demo model of
tests/conftest.py made with MKL's own choice and with its compatible path has two different
sha256s.

`pin_cpu_kernels` asks ATen for its AVX2 kernels and MKL for its compatible path in strict
mode, unless the environment already names them. MKL's compatible path is the one its
documentation promises gives the same results on Intel and other processors (asked for AVX2,
MKL on that AMD processor reported its "auto" branch instead, which follows the processor),
and strict mode is its strictest reproducibility (the project's runs fix the thread count
themselves). It costs speed: the quick demo warm start took 23-25 CPU seconds against 18-19
with MKL's AVX2 request. Both libraries read their setting once, at their first computation,
so the pin runs at the entry points that compute, before any tensor maths: the `megatron-fr`
command's train, serve, demo, compare and convert (cli.py), the CPU engine's server and the
test session (tests/conftest.py); child processes (learner ranks, the CPU engine, spawned test
ranks) inherit it. Importing the package does not pin: a process that only reads a recipe
keeps its environment as it was given.
MEGATRON_FR_NATIVE_CPU_KERNELS=1 leaves the kernels to the libraries (faster, not
reproducible across machines). GPU kernels are not affected.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path

PINNED = {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "avx2"}
"""The environment that selects the pinned kernels: MKL's conditional numerical
reproducibility branch, and ATen's dispatch capability."""

OPT_OUT = "MEGATRON_FR_NATIVE_CPU_KERNELS"


def has_avx2(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this is an x86 processor that lists AVX2 (False where that cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return "avx2" in flags.split()


def pin_cpu_kernels(
    environ: MutableMapping[str, str] = os.environ, avx2: bool | None = None
) -> dict[str, str]:
    """Sets each variable of PINNED that `environ` does not already set, on a processor with
    AVX2 and unless OPT_OUT is 1; returns what it set."""
    if environ.get(OPT_OUT) == "1" or not (has_avx2() if avx2 is None else avx2):
        return {}
    added = {name: value for name, value in PINNED.items() if name not in environ}
    environ.update(added)
    return added
