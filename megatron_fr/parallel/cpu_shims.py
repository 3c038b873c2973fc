"""CPU compatibility shims for megatron-core 0.19.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths.
Every shim here covers exactly one megatron function or assumption and changes nothing on a
machine with CUDA. A program installs them ONCE, at its entry point, with install_cpu_shims()
(the `megatron-fr` command, the rank processes of parallel/spawn.py, the tools, the test
suite's conftest); nothing installs them as a side effect of an import. Three kinds:

* the import shim: ``import megatron.core`` needs triton for one CUDA-only module;
* runtime shims: megatron functions that call torch.cuda (RNG states, streams, the current
  device, synchronize) or feed gloo collectives it cannot take;
* the device mode: megatron's DDP, optimizers, schedules and checkpointing allocate on
  "cuda", move tensors ``.cuda()`` and check ``param.type()`` against torch.cuda type names
  in dozens of places; a TorchFunctionMode entered once for the process's main thread (where
  the learner runs) puts those tensors on the CPU instead.

Each runtime shim replaces one attribute (a torch.cuda function, or a name inside the megatron
module that calls it) and marks the replacement, so installing twice is a no-op. What they
replace fails on a CPU-only torch build, or feeds a gloo collective that then fails, so no
shim changes anything that already worked. Checked by the multi-process tests: model build,
forward and backward of a MoE GPT on every layout (TP, SP, EP, PP, CP, packed rows), full and
selective activation recompute, DDP, the distributed optimizer and dist_checkpointing.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"
_SHIM_MARK = "_megatron_fr_cpu_shim"
_INSTALLED = False


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

    def _unavailable(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("megatron's paged-stash kernels need triton and CUDA")

    vars(stand_in).update(
        GLOBAL_BLOCK_SIZE=1024,
        paged_stash_copy_kernel=_unavailable,
        paged_stash_pop_kernel=_unavailable,
    )
    sys.modules[_PAGED_STASH_OPS] = stand_in


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def install_cpu_shims(*, device_mode: bool = True) -> None:
    """Everything megatron needs on a machine without CUDA (idempotent; on a CUDA machine only
    the import shim, and that only when triton is missing). Call it at a program's entry
    point, in the thread that will run megatron, before megatron is imported.

    device_mode=False leaves the device mode out: for a process that runs megatron's models
    but not its DDP, optimizers or schedules (the test suite's own process), where the mode
    would only slow every torch call down (about 1.8x for a tiny model's forward)."""
    install_import_shims()
    if not cuda_absent():
        return
    _shim_rng_tracker()  # model_parallel_cuda_manual_seed, weight init
    _shim_recompute_rng_states()  # activation recompute (full and selective)
    _shim_current_device()  # allocations "on the current device"
    _shim_synchronize()  # pipeline point-to-point sends
    _shim_torch_norm_sequence_parallel()  # norms under sequence parallelism
    _shim_default_causal_mask()  # attention without an explicit mask
    _shim_cuda_streams()  # MoE alltoall dispatcher's side stream
    _shim_numpy_split_sizes()  # MoE alltoall split sizes
    _shim_uneven_gather()  # MoE alltoall under TP + SP
    _shim_checkpoint_preload()  # dist_checkpointing.save (torch_dist)
    global _INSTALLED
    _INSTALLED = True
    if device_mode and _DEVICE_MODE is None:
        _enter_device_mode()


def check_installed() -> None:
    """Raise, with the remedy, when megatron is about to run without CUDA and without the
    shims (a program that forgot install_cpu_shims at its entry point)."""
    if cuda_absent() and not _INSTALLED:
        raise RuntimeError(
            "megatron on a machine without CUDA needs the CPU shims: call "
            "megatron_fr.parallel.cpu_shims.install_cpu_shims() at the program's entry point"
        )


def _replace(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Set ``owner.name = make(original)`` and mark it, unless a shim already replaced it."""
    original = getattr(owner, name)
    if getattr(original, _SHIM_MARK, False):
        return
    replacement = make(original)
    setattr(replacement, _SHIM_MARK, True)
    setattr(owner, name, replacement)


# --- RNG: megatron.core.tensor_parallel.random ------------------------------------------------


def _shim_rng_tracker() -> None:
    """Covers CudaRNGStatesTracker, which model_parallel_cuda_manual_seed seeds and which
    megatron forks to initialise TP-split weights (and for dropout in TP regions).

    The tracker keeps named CUDA generator states and swaps them in with fork(); on CPU the
    same is done with the CPU default generator. initialize_rng_tracker looks the class up by
    module name when it builds the tracker, so replacing that attribute is enough; a tracker
    built before the shim is dropped so that the next get_cuda_rng_tracker() builds ours.
    """
    from megatron.core.tensor_parallel import random

    _replace(random, "CudaRNGStatesTracker", _cpu_rng_tracker_class)
    tracker = random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not getattr(type(tracker), _SHIM_MARK, False):
        random._CUDA_RNG_STATE_TRACKER = None
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _cpu_rng_tracker_class(base: type) -> type:
    """A CudaRNGStatesTracker whose states are CPU generator states; same bookkeeping and
    errors as megatron's add/fork, minus its warning that the CPU state changed in a fork."""
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    class CpuRNGStatesTracker(base):
        _current_state_name: str
        """The state in use (megatron's tracker sets it: reset() and fork())."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_name, outer_state = self._current_state_name, torch.get_rng_state()
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    return CpuRNGStatesTracker


def _shim_recompute_rng_states() -> None:
    """Covers random._get_cuda_rng_state / _set_cuda_rng_state, with which activation
    recompute (CheckpointFunction for full recompute, CheckpointWithoutOutput for selective,
    _fork_rng) saves the CUDA generator's state at the forward and restores it before the
    recomputation. A CPU-only build has no CUDA generator: there is no state to keep (the
    CPU generator and the tracker's states, which megatron saves and restores beside it, are
    all the randomness there is), so the state is an empty tensor and setting it a no-op."""
    from megatron.core.tensor_parallel import random

    _replace(
        random,
        "_get_cuda_rng_state",
        lambda _original: lambda *_args, **_kwargs: torch.empty(0, dtype=torch.uint8),
    )
    _replace(random, "_set_cuda_rng_state", lambda _original: lambda *_args, **_kwargs: None)


# --- devices and streams: torch.cuda as megatron calls it -------------------------------------


def _shim_current_device() -> None:
    """Covers ``device=torch.cuda.current_device()`` across megatron (GlobalMemoryBuffer in
    attention, tensor_parallel.layers and mappings, the MoE router): what megatron allocates
    "on the current device" lands on the CPU."""
    _replace(torch.cuda, "current_device", lambda _original: lambda: "cpu")


def _shim_synchronize() -> None:
    """Covers torch.cuda.synchronize, which the pipeline's point-to-point communication
    (p2p_communication._communicate) calls after its sends and receives: the CPU's are
    complete when they return."""
    _replace(torch.cuda, "synchronize", lambda _original: lambda *_args, **_kwargs: None)


class _NoOpEvent:
    """Stands in for the event a _NoOpStream records: CPU work is already complete."""

    def synchronize(self) -> None: ...


class _NoOpStream:
    """Stands in for torch.cuda.Stream: on the CPU there is one in-order stream."""

    def wait_stream(self, _other: object) -> None: ...

    def record_event(self, _event: object = None) -> _NoOpEvent:
        return _NoOpEvent()


_CPU_STREAM = _NoOpStream()


def _shim_cuda_streams() -> None:
    """Covers MoEAlltoAllTokenDispatcher's device-to-host side stream: its __init__ creates a
    torch.cuda.Stream(), and _maybe_dtoh_and_synchronize compares it with current_stream(),
    waits on it, records an event and synchronises that. All of it is a no-op on the CPU
    (torch.cuda.stream(s) itself already is when no CUDA device exists)."""
    _replace(torch.cuda, "Stream", lambda _original: _NoOpStream)
    _replace(torch.cuda, "current_stream", lambda _original: lambda *_args: _CPU_STREAM)


# --- norms: megatron.core.transformer.torch_norm ----------------------------------------------


def _shim_torch_norm_sequence_parallel() -> None:
    """Covers WrappedTorchNorm (the norm of the local spec when neither TE nor apex exists),
    which refuses config.sequence_parallel. Sequence parallelism changes nothing in a norm's
    forward; it only means the weight's gradient is a partial sum over the TP group. So the
    norm is built as if SP were off and its parameters are tagged ``sequence_parallel``, as
    TE's norms do, for finalize_model_grads to all-reduce."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, _SHIM_MARK, False):
        return

    @functools.wraps(original)
    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    setattr(new, _SHIM_MARK, True)
    WrappedTorchNorm.__new__ = staticmethod(new)


# --- attention: megatron.core.fusions.fused_softmax --------------------------------------------


def _shim_default_causal_mask() -> None:
    """Covers FusedScaleMaskSoftmax.forward_torch_softmax (the unfused softmax of the local
    spec), which, when no attention mask is passed, builds megatron.core.transformer.utils.
    get_default_causal_mask with ``device="cuda"``. The copy fused_softmax imported by name
    is replaced with one that builds the same mask on the CPU."""
    from megatron.core.fusions import fused_softmax

    def make(original: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
        @functools.wraps(original)
        def causal_mask(sq: int) -> torch.Tensor:
            return torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1)

        return causal_mask

    _replace(fused_softmax, "get_default_causal_mask", make)


# --- MoE token dispatcher and its collectives -------------------------------------------------


def _shim_numpy_split_sizes() -> None:
    """Covers megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu.

    It converts the all-to-all split sizes to numpy only when they are CUDA tensors, so on the
    CPU they stay tensors and all_to_all_single rejects them (it wants a list of ints)."""
    from megatron.core.transformer.moe import token_dispatcher

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        return move

    _replace(token_dispatcher, "maybe_move_tensor_to_cpu", make)


def _shim_uneven_gather() -> None:
    """Covers tensor_parallel.mappings._gather_along_first_dim with output_split_sizes: the
    alltoall dispatcher's all-gather of routed tokens over TP under sequence parallelism
    (gather_from_sequence_parallel_region, and the backward of its reduce-scatter). gloo's
    all_gather refuses unequal sizes, so each rank writes its rows into zeros of the full
    size and the group sums them with all_reduce (exact: every row has one non-zero source).
    The uneven reduce-scatter works on gloo as it is."""
    from megatron.core.tensor_parallel import mappings

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def gather(
            input_: Tensor,
            group: ProcessGroup,
            output_split_sizes: list[int] | None = None,
            use_global_buffer: bool = False,
        ) -> Tensor:
            if output_split_sizes is None or group.size() == 1:
                return original(input_, group, output_split_sizes, use_global_buffer)
            start = sum(output_split_sizes[: group.rank()])
            output = input_.new_zeros((sum(output_split_sizes), *input_.shape[1:]))
            output[start : start + input_.shape[0]] = input_
            torch.distributed.all_reduce(output, group=group)
            return output

        return gather

    _replace(mappings, "_gather_along_first_dim", make)


# --- the device mode: megatron's DDP, optimizers, schedules, checkpointing -----------------------


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in torch calls to the CPU; ``tensor.cuda()`` stays put, and
    host tensors are not pinned (``pin_memory=True``, as RoPE's context-parallel slicing,
    rope_utils.get_pos_emb_on_this_cp_rank, asks, needs an accelerator)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        _types: Collection[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers check param.type() against the torch.cuda.* type names
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


_DEVICE_MODE: _CudaDeviceToCpu | None = None


def _enter_device_mode() -> None:
    """Enter the mode for the rest of the process, in the calling thread (torch keeps mode
    stacks per thread: the learner, its schedules and their backward passes on the CPU all
    run in the thread that calls them)."""
    global _DEVICE_MODE
    _DEVICE_MODE = _CudaDeviceToCpu()
    _DEVICE_MODE.__enter__()


# --- dist_checkpointing: megatron.core.dist_checkpointing.strategies.filesystem_async ---------


def _shim_checkpoint_preload() -> None:
    """Covers FileSystemWriterAsync.preload_tensors, which after its device-to-host copies calls
    torch.cuda.synchronize() whenever non_blocking (the default); on the CPU the copies are
    already synchronous, so it is called with non_blocking=False."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def preload(write_buckets: Any, non_blocking: bool = True) -> Any:
            return original(write_buckets, non_blocking=False)

        return staticmethod(preload)

    _replace(FileSystemWriterAsync, "preload_tensors", make)
