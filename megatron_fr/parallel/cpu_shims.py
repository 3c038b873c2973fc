"""CPU compatibility shims for megatron-core 0.19 (see shared notes: cpu-megatron).

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths.
Every shim here covers exactly one megatron function or assumption, is installed only when
CUDA is absent, and never changes behaviour on a GPU machine. Two kinds:

* import shims (install_import_shims): needed before ``import megatron.core`` can succeed;
* runtime shims (apply_cpu_shims): needed before megatron models, schedules or optimizers run.

One extension is not about the CPU: apply_local_spec_attention gives the local spec's core
attention the packed rows (THD) and context parallelism that megatron implements in TE only.
It is installed wherever the local spec runs (no transformer-engine), on CPU and GPU alike.

Each runtime shim replaces one attribute (a torch.cuda function, or a name inside the megatron
module that calls it) and marks the replacement, so applying them twice is a no-op. What they
replace fails on a CPU-only torch build, or feeds a gloo collective that then fails, so no
shim changes anything that already worked. Checked (tests/distributed/test_megatron_cpu.py):
model build, forward and backward of a MoE GPT on the local spec at TP1, TP2+SP, EP2 and
TP2xEP2, and get_forward_backward_func() at PP=1; packed rows and context parallelism through
the learner (tests/distributed/test_packing_cp.py: equal to the padded CP1 step). Not yet
covered: activation recompute, PP>1 schedules, DDP/finalize_model_grads and the optimizers.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"
_SHIM_MARK = "_megatron_fr_cpu_shim"


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
    _shim_rng_tracker()  # model_parallel_cuda_manual_seed, weight init
    _shim_current_device()  # allocations "on the current device"
    _shim_torch_norm_sequence_parallel()  # norms under sequence parallelism
    _shim_default_causal_mask()  # attention without an explicit mask
    _shim_cuda_streams()  # MoE alltoall dispatcher's side stream
    _shim_numpy_split_sizes()  # MoE alltoall split sizes
    _shim_uneven_gather()  # MoE alltoall under TP + SP
    _shim_schedule_cuda_device()  # get_forward_backward_func() at PP=1
    _shim_checkpoint_preload()  # dist_checkpointing.save (torch_dist)
    _shim_tied_embedding_sync()  # tied embeddings at PP > 1


def apply_local_spec_attention() -> None:
    """Packed rows and CP for the local spec's attention (idempotent; a no-op where the model
    is built with transformer-engine's spec, whose attention has both)."""
    from megatron_fr.models.gpt import use_transformer_engine

    if not use_transformer_engine():
        _shim_local_attention()


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


# --- devices and streams: torch.cuda as megatron calls it -------------------------------------


def _shim_current_device() -> None:
    """Covers ``device=torch.cuda.current_device()`` across megatron (GlobalMemoryBuffer in
    attention, tensor_parallel.layers and mappings, the MoE router): what megatron allocates
    "on the current device" lands on the CPU."""
    _replace(torch.cuda, "current_device", lambda _original: lambda: "cpu")


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


def _shim_local_attention() -> None:
    """Covers DotProductAttention (the local spec's core attention), which refuses context
    parallelism in __init__ and PackedSeqParams in forward: megatron runs both through
    TEDotProductAttention only (TE needs CUDA, and a GPU may lack it). The replacement computes
    what TE computes:

    * a packed row (qkv_format "thd", [tokens, heads, dim]) is attended as one row
      [tokens, 1, heads, dim] under the block-diagonal causal mask of cu_seqlens (TE's
      padding_causal: a token sees the earlier tokens of its own sequence);
    * with CP > 1, keys and values are all-gathered over the CP group (backward: their
      gradients reduce-scattered, megatron's gather_from_sequence_parallel_region) and each
      local query attends to the gathered keys under the causal mask of their row positions,
      known from megatron's zigzag split (parallel/context_parallel.py): the algorithm of TE's
      cp_comm_type "all_gather". A padded row (no PackedSeqParams) is one sequence.

    Everything around the attention product is megatron's own: THD RoPE restarting at each
    sequence, RoPE's CP slicing, the CP split of the rotary tables, the gradient reductions.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def make_init(original: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(original)
        def init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            if config.context_parallel_size > 1:  # the product itself is CP-agnostic
                config = copy.copy(config)
                config.context_parallel_size = 1
            original(self, config, *args, **kwargs)

        return init

    def make_forward(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(self: Any, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):  # fmt: skip
            group = _context_parallel_group(self)
            if packed_seq_params is None and group.size() == 1:
                return original(self, query, key, value, attention_mask, attn_mask_type,
                                attention_bias)  # fmt: skip
            if attention_mask is not None:
                raise ValueError("packed rows and CP take their mask from the row layout")
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                padded = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if padded is None else padded
                boundaries = cu.tolist()
                query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            else:
                boundaries = [0, query.size(0) * group.size()]
            mask = _row_causal_mask(boundaries, group).to(query.device)
            if group.size() > 1:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                key, value = (
                    gather_from_sequence_parallel_region(x.contiguous(), True, group=group)
                    for x in (key, value)
                )
            return original(self, query, key, value, mask, attn_mask_type, attention_bias)

        return forward

    _replace(DotProductAttention, "__init__", make_init)
    _replace(DotProductAttention, "forward", make_forward)


def _context_parallel_group(attention: Any) -> Any:
    group = getattr(attention.pg_collection, "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


def _row_causal_mask(boundaries: list[int], group: Any) -> torch.Tensor:
    """[1, 1, local queries, gathered keys] bool, True where attention is masked (megatron's
    convention): a key of another sequence, or one later in the row than the query."""
    from megatron_fr.parallel.context_parallel import segment_of, zigzag_indices

    size, rank = group.size(), group.rank()
    queries = zigzag_indices(boundaries, size, rank)
    keys = torch.cat([zigzag_indices(boundaries, size, r) for r in range(size)])
    other = segment_of(boundaries, queries)[:, None] != segment_of(boundaries, keys)[None, :]
    return (other | (keys[None, :] > queries[:, None]))[None, None]


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
        def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
            if output_split_sizes is None or group.size() == 1:
                return original(input_, group, output_split_sizes, use_global_buffer)
            start = sum(output_split_sizes[: group.rank()])
            output = input_.new_zeros((sum(output_split_sizes), *input_.shape[1:]))
            output[start : start + input_.shape[0]] = input_
            torch.distributed.all_reduce(output, group=group)
            return output

        return gather

    _replace(mappings, "_gather_along_first_dim", make)


# --- pipeline schedules: megatron.core.pipeline_parallel.schedules ----------------------------


class _CudaDeviceToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` in torch calls to the CPU; ``tensor.cuda()`` stays put, and
    host tensors are not pinned (``pin_memory=True``, as RoPE's context-parallel slicing,
    rope_utils.get_pos_emb_on_this_cp_rank, asks, needs an accelerator)."""

    def __torch_function__(self, func, _types, args=(), kwargs=None):
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


def cpu_device_mode():
    """Context for megatron code that allocates on "cuda" or checks torch.cuda.* tensor types
    (DDP, the distributed optimizer, grad clipping, finalize_model_grads, checkpointing of
    optimizer state): on a machine without CUDA those run on the CPU; elsewhere a no-op."""
    return _CudaDeviceToCpu() if cuda_absent() else contextlib.nullcontext()


def _shim_schedule_cuda_device() -> None:
    """Covers schedules.forward_backward_no_pipelining (what get_forward_backward_func returns
    at PP=1), which counts tokens in ``torch.zeros([], device="cuda")``. The schedule runs
    under a mode that puts such tensors on the CPU; get_forward_backward_func looks the
    schedule up by name, so replacing the module attribute is enough."""
    from megatron.core.pipeline_parallel import schedules

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def schedule(*args: Any, **kwargs: Any) -> Any:
            with _CudaDeviceToCpu():
                return original(*args, **kwargs)

        return schedule

    _replace(schedules, "forward_backward_no_pipelining", make)


def _shim_tied_embedding_sync() -> None:
    """Covers LanguageModule.setup_embeddings_and_output_layer, which at PP > 1 with tied
    embeddings moves the last stage's copy of the embedding ``.cuda()`` before all-reducing it
    from the first stage; under the mode the copy stays on the CPU and gloo reduces it."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _CudaDeviceToCpu():
                return original(self, *args, **kwargs)

        return setup

    _replace(LanguageModule, "setup_embeddings_and_output_layer", make)


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
