"""CPU compatibility shims for megatron-core 0.19 (see shared notes: cpu-megatron).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths.
Every shim here covers exactly one megatron function or assumption, is installed only when
CUDA is absent, and never changes behaviour on a GPU machine. Two kinds:

* import shims (install_import_shims): needed before ``import megatron.core`` can succeed;
* runtime shims (apply_cpu_shims): needed before megatron models, schedules or optimizers run.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def install_import_shims() -> None:
    """Make ``import megatron.core`` work without triton (idempotent).

    Covers megatron.core.transformer.moe.ops.paged_stash, which imports triton unguarded to
    define its paged-stash Triton kernels (a CUDA-only MoE memory feature). When triton is
    missing, that one module is replaced by a stand-in whose kernels raise if ever launched.
    triton itself is NOT stubbed: torch._dynamo probes for it and would break.
    """
    if _PAGED_STASH_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stand_in = types.ModuleType(_PAGED_STASH_OPS)
    stand_in.__doc__ = "megatron-fr stand-in: the paged-stash Triton kernels need triton + CUDA."
    stand_in.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("megatron's paged-stash kernels need triton and CUDA")

    stand_in.paged_stash_copy_kernel = _unavailable
    stand_in.paged_stash_pop_kernel = _unavailable
    sys.modules[_PAGED_STASH_OPS] = stand_in


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Install the runtime shims when CUDA is absent (idempotent; a no-op on GPU machines)."""
    if not cuda_absent():
        return
    install_import_shims()
