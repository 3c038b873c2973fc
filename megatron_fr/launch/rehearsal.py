"""One learner step of a recipe rehearsed on a CPU: the chosen rank's learner, at its real
shapes and layout, built and stepped under fake tensors in a fake world, its memory measured.

    megatron-fr train RECIPE --rehearse [--rank R | --stages] [--world-size N]
        [--gpu-mem-gb G] [--skew S] [--layers N] [--cpu-kernels]

The technique of torchtitan's memory estimation: torch's FakeTensorMode (tensors with shapes
and dtypes, no storage), the "fake" process-group backend on a FakeStore (collectives return
at once: every rank is assumed to do what this one does), and
torch.distributed._tools.mem_tracker.MemTracker (storages by kind: parameters, gradients,
optimizer state, activations, temporaries; here only the step's peak is kept). The learner is
the project's own (Learner, its step plan, micro-batching, loss path, megatron's DDP and
distributed optimizer), built on fake CPU tensors with the CPU shims (parallel/cpu_shims.py:
a CPU-only torch cannot hold fake CUDA tensors), so the CPU's kernels are the ones chosen.
Where a GPU's keep other memory, gpu_kernels() stands in for them unless asked not to: the
fused rms_norm (its input and a float32 inverse RMS per row kept, where the CPU's composite
keeps float32 copies of the input) and torch Adam's foreach kernels (a float32 temporary of
the optimizer shards, where the CPU loops per parameter); the CPU's attention tile
(models/chunked_attention.py), which a GPU's flash kernels do not build, is left out.

What runs: the recipe's worst-case batch (B rows at the longest row a micro-batch holds)
through the real step plan and this rank's micro-batching; a first optimizer step on zero
gradients (it creates the Adam state, as Learner.load does), then a second, measured one:
this rank's first PP micro-batches through megatron's schedule (1F1B keeps at most PP of them
in flight, so memory does not grow after those), gradient finalisation and the distributed
optimizer's step with the Adam state in place.

The patches below are what a fake world cannot do as the real one does; all are scoped
replacements (rehearsal_patches(), a context manager), undone on exit:
  object collectives     every rank's object is this rank's (symmetric ranks)
  scalar reads           `.item()` of a fake float or bool reads 0 (the grad norm, found-inf
                         flags); a fake integer (a size) is refused as the fake mode does
  small host metadata    integer tensors of up to CONSTANT_NUMEL elements made under the
                         fake mode keep their values (cu_seqlens, the dispatcher's counts)
  MoE split sizes        the all-to-all dispatcher's counts are balanced (every expert gets
                         tokens x top-k / E of every rank), this rank's experts (1 + skew)
                         times that where asked: real routing is data-dependent
  coalesced collectives  the DDP's reduce-scatters issued one by one (the fake backend has
                         no coalesced kernel)
  megatron's L2 norm     its no-apex fallback builds torch.tensor() from 0-d tensors: stacked
  grouped GEMMs          the experts of a dtype other than bf16 (the CPU demo's float32) one
                         matmul per expert, as on a GPU, where CUDA's grouped_mm takes bf16
                         only; the fake mode's meta function checks that rule on any device
The project itself has no data-dependent shapes where a size is known (the grouped experts'
repeat_interleave, the gate's sums and diagnostics), skips the loss's input checks under
parallel/loss.py's skip_input_checks(), and builds no gloo side groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_fr.buffer.trajectory import Trajectory
    from megatron_fr.config.run import RunConfig
    from megatron_fr.learner.step_plan import StepPlan
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import HFModelSpec

GIB = 2**30
CONSTANT_NUMEL = 1 << 16
"""Integer host metadata up to this many elements stays real under the fake mode."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one rank holds, by part, at its peak (the measured step)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    """Kept for the backward (MemTracker's activations at the peak)."""
    temporaries: int
    """Working memory of the backward and the optimizer at the peak, and any other storage."""
    peak: int
    stage: int
    """The rank's pipeline stage."""
    seconds: float


# --- the fake world -------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """torch.distributed as rank `rank` of `world` on the fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        from megatron_fr.parallel.state import destroy

        destroy()
        dist.destroy_process_group()


@contextlib.contextmanager
def gpu_kernels() -> Iterator[None]:
    """The memory behaviour of the kernels a GPU runs where the CPU's differ (module
    docstring), undone on exit."""
    from torch.optim import adam

    with (
        mock.patch.object(torch.nn.functional, "rms_norm", _fused_rms_norm),
        mock.patch.object(adam, "_default_to_fused_or_foreach", _foreach),
    ):
        yield


def _foreach(*_args: Any, **_kwargs: Any) -> tuple[bool, bool]:
    return False, True  # (fused, foreach): torch's choice for CUDA tensors


def _fused_rms_norm(
    x: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    if weight is None or weight.dtype != x.dtype or len(normalized_shape) != 1:
        return torch.rms_norm(x, normalized_shape, weight, eps)
    return _FusedRMSNorm.apply(x, weight, 1e-6 if eps is None else eps)


class _FusedRMSNorm(torch.autograd.Function):
    """RMS norm over the last dimension keeping what CUDA's fused kernel keeps for the
    backward: its input and the float32 inverse RMS of each row (the CPU's composite keeps
    float32 copies of the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = _wide(x)
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (wide * rstd * _wide(weight)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = _wide(x) * rstd
        grad_weight = (_wide(grad) * normed).reshape(-1, x.shape[-1]).sum(0)
        scaled = _wide(grad) * _wide(weight)
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in the kernels' accumulation type: float32, or float64 for float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@contextlib.contextmanager
def rehearsal_patches(skew: float = 0.0) -> Iterator[None]:
    """Every patch of the module docstring, undone on exit."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from torch._subclasses import fake_impls, fake_tensor

    from megatron_fr.models import torch_spec

    scalar = torch.ops.aten._local_scalar_dense.default
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(dist, "all_gather_object", _own_object))
        stack.enter_context(
            mock.patch.dict(fake_impls.op_implementations_dict, {scalar: _zero_scalar})
        )
        stack.enter_context(mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", CONSTANT_NUMEL))
        stack.enter_context(
            mock.patch.object(MoEAlltoAllTokenDispatcher, "preprocess", _balanced_preprocess(skew))
        )
        stack.enter_context(
            mock.patch.object(param_and_grad_buffer, "_coalescing_manager", _one_by_one)
        )
        stack.enter_context(mock.patch.object(clip_grads, "l2_norm_impl", _l2_norm))
        stack.enter_context(
            mock.patch.object(torch_spec, "_grouped_mm", _grouped_mm_as_on_a_gpu(torch_spec))
        )
        yield


def _own_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    object_list[:] = [obj] * len(object_list)


def _zero_scalar(fake_mode: Any, func: Any, arg: torch.Tensor) -> float | bool:
    """A fake float or bool read as 0 (the grad norm, found-inf flags); integers, which
    would be sizes, are refused as the fake mode refuses them."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    if arg.dtype.is_floating_point:
        return 0.0
    if arg.dtype == torch.bool:
        return False
    raise DataDependentOutputException(func)


@contextlib.contextmanager
def _one_by_one(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[Any]:
    yield None


def _l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], *args: Any
) -> tuple[torch.Tensor, None]:
    norms = [torch.linalg.vector_norm(t.float()) for tensors in tensor_lists for t in tensors]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _grouped_mm_as_on_a_gpu(torch_spec: Any) -> Callable[..., torch.Tensor]:
    """models/torch_spec._grouped_mm as it runs on a GPU: the grouped kernel for bf16, one
    matmul per group for any other dtype (module docstring)."""
    grouped = torch_spec._grouped_mm

    def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Any, counts: list[int]) -> Any:
        if a.dtype == torch.bfloat16:
            return grouped(a, b, offs, counts)
        spans = list(itertools.pairwise(itertools.accumulate([0, *counts])))
        if b.dim() == 3:
            return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(spans)])
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in spans])

    return grouped_mm


def _balanced_preprocess(skew: float) -> Callable[..., torch.Tensor]:
    """MoEAlltoAllTokenDispatcher.preprocess with host counts in place of the routing map's:
    each rank sends tokens x top-k / E to every expert; this rank's experts receive (1 +
    skew) times that from every rank."""

    def preprocess(self: Any, routing_map: torch.Tensor) -> torch.Tensor:
        tokens, experts = routing_map.shape
        local, ep, tp = self.num_local_experts, self.ep_size, self.tp_size
        sent = tokens * self.config.moe_router_topk // experts
        received = int(sent * (1 + skew))
        self.num_out_tokens = tokens * self.config.moe_router_topk
        if ep > 1 or tp > 1:  # numpy, as megatron's device-to-host step leaves them
            self.input_splits = np.full(ep, sent * local)
            self.output_splits = np.full(ep, received * local)
            self.output_splits_tp = np.full(tp, received * local * ep)
            self._maybe_update_cuda_sync_point("before_ep_alltoall")
        else:
            self._maybe_update_cuda_sync_point("before_finish")
        if local > 1:  # small constants the fake mode keeps values of (CONSTANT_NUMEL)
            self.num_global_tokens_per_local_expert = torch.tensor([[received] * local] * tp * ep)
            chunks = np.arange(experts * tp).reshape(-1, local)
            self.sort_input_by_local_experts = torch.tensor(chunks.T.ravel().tolist())
            restore = np.arange(experts * tp).reshape(local, -1).T.ravel()
            self.restore_output_by_local_experts = torch.tensor(restore.tolist())
            if not self.config.moe_permute_fusion:
                self._maybe_update_cuda_sync_point("before_permutation_2")
        return torch.tensor([received * tp * ep] * local)

    return preprocess


# --- the rehearsed step ---------------------------------------------------------------------


def rehearse(
    config: RunConfig,
    spec: HFModelSpec,
    *,
    world: int,
    rank: int,
    skew: float = 0.0,
    cpu_kernels: bool = False,
    hf_dir: str | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> Memory:
    """Rank `rank`'s learner of `config` for the model `spec` on `world` fake ranks: its
    memory over the measured step (module docstring), with the GPU's kernels' memory
    (gpu_kernels) unless `cpu_kernels`; `hf_dir`: an HF checkpoint whose tensor names and
    shapes are first checked against this rank's shards (headers only: no weight is read).
    Needs the CPU shims installed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models import chunked_attention
    from megatron_fr.parallel.loss import skip_input_checks
    from megatron_fr.parallel.state import initialize

    start = time.monotonic()
    chunked_attention.lower_right_tile.cache_clear()  # a tile of another fake mode
    tiles = chunked_attention.MASKS.host_bytes
    kernels = contextlib.nullcontext() if cpu_kernels else gpu_kernels()
    with fake_world(rank, world), rehearsal_patches(skew), kernels, skip_input_checks():
        initialize(config.parallel, seed=config.seed)
        with FakeTensorMode(allow_non_fake_inputs=True):
            learner = Learner(
                spec,
                config.parallel,
                config.learner,
                total_steps=config.steps,
                temperature=config.rollout.temperature,
                spec_kind=config.model.spec or "torch",
            )
            progress(f"built rank {rank}'s learner ({time.monotonic() - start:.0f} s)")
            if hf_dir is not None:
                from megatron_fr.convert.parallel_load import check_hf_dir

                check_hf_dir(learner.module, hf_dir, spec)
            memory = measure_step(config, learner, progress)
    chunked_attention.lower_right_tile.cache_clear()
    # a GPU's flash kernels align the causal mask inside the kernel: no tile there
    tiles = 0 if cpu_kernels else chunked_attention.MASKS.host_bytes - tiles
    return dataclasses.replace(
        memory,
        activations=memory.activations - tiles,
        peak=memory.peak - tiles,
        seconds=time.monotonic() - start,
    )


def measure_step(
    config: RunConfig, learner: Learner, progress: Callable[[str], None] = lambda _line: None
) -> Memory:
    """A learner's memory over the measured step of the module docstring (fake tensors or
    real ones: tests/distributed/test_rehearsal.py measures both)."""
    start = time.monotonic()
    learner.model.zero_grad_buffer()
    learner.optimizer.step()  # the Adam state, as Learner.load makes it
    step, rows = worst_case_step(config, learner)
    weights, grads, optimizer = _state_bytes(learner)
    tracker = _tracker()
    tracker.track_external(learner.module, *_external_state(learner))
    with tracker, _layer_progress(learner, progress):
        learner.accumulate_gradients(step, rows)
        learner.optimizer.step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    activations = peak["Activation"]
    return Memory(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        temporaries=peak["Total"] - weights - grads - optimizer - activations,
        peak=peak["Total"],
        stage=learner.groups.pp.rank(),
        seconds=time.monotonic() - start,
    )


def worst_case_step(config: RunConfig, learner: Learner) -> tuple[StepPlan, dict[int, Trajectory]]:
    """The recipe's worst-case batch (B trajectories, each the longest row a micro-batch
    holds) planned by the learner (its step plan and micro-batching), kept to this rank's
    first PP micro-batches: (step plan, the trajectories they hold by batch index)."""
    from megatron_fr.buffer.trajectory import Trajectory
    from megatron_fr.config.learner import longest_row

    parallel, size = config.parallel, config.buffer.batch_size
    tp = parallel.tensor if parallel.sequence_parallel else 1
    length = longest_row(config.learner.micro_batch_tokens, parallel.context, tp)
    group_size = config.buffer.group_size
    batch = [
        Trajectory(
            f"rehearsal-{index}",
            np.ones(length, dtype=np.int32),
            np.arange(length) > 0,  # the first token is the prompt
            np.where(np.arange(length) > 0, -1.0, 0.0).astype(np.float32),
            np.where(np.arange(length) > 0, 0, -1).astype(np.int32),
            float(index % 2),
            info={"group": index // group_size},
        )
        for index in range(size)
    ]
    step = learner.plan(batch)
    dp_rank = learner.groups.dp.rank()
    assignment = list(step.plan.assignment)
    assignment[dp_rank] = assignment[dp_rank][: learner.groups.pp.size()]
    step = dataclasses.replace(step, plan=dataclasses.replace(step.plan, assignment=assignment))
    rows = {i: batch[i] for micro in assignment[dp_rank] for row in micro for i in row}
    return step, rows


def _storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count once)."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gradient_buffers(learner: Learner) -> list[torch.Tensor]:
    ddp = learner.model
    return [buffer.grad_data for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]]


def _optimizer_tensors(learner: Learner) -> list[torch.Tensor]:
    """The distributed optimizer's fp32 main shards and Adam state."""
    from megatron_fr.learner.trainer import torch_optimizers

    tensors = []
    for inner in torch_optimizers(learner.optimizer):
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return tensors


def _state_bytes(learner: Learner) -> tuple[int, int, int]:
    """(weights, gradient buffers, optimizer) bytes of the model state."""
    return (
        _storage_bytes(learner.module.parameters()),
        _storage_bytes(_gradient_buffers(learner)),
        _storage_bytes(_optimizer_tensors(learner)),
    )


def _external_state(learner: Learner) -> list[Any]:
    """What MemTracker must count that was made before it started, beside the module."""
    from megatron_fr.learner.trainer import torch_optimizers

    optimizers = torch_optimizers(learner.optimizer)
    return [*_gradient_buffers(learner), *_optimizer_tensors(learner), *optimizers]


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        """MemTracker for one step of several micro-batches, with megatron's DDP seen
        through to its module: DDP's list attribute `buffers` shadows Module.buffers(),
        which MemTracker calls on every module."""

        def _track_module_params_and_buffers(
            self, module: torch.nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            if not callable(getattr(module, "buffers")):  # noqa: B009 (shadowed, typed)
                return super()._track_module_params_and_buffers(
                    cast(torch.nn.Module, module.module), install_grad_hooks
                )
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            """Modules run once per micro-batch (MemTracker refuses a second forward of a
            root module): a later forward has nothing new to track."""
            if module not in self.memory_tracking or self._mod_tracker.is_bw:
                super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            """The peak of the whole step only: MemTracker's per-module peaks, updated at
            every operation for every module, take most of a large model's rehearsal."""
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)

    return Tracker


def _tracker() -> Any:
    return _tracker_class()()


@contextlib.contextmanager
def _layer_progress(learner: Learner, progress: Callable[[str], None]) -> Iterator[None]:
    """progress(line) at every decoder layer's forward, recomputation and backward."""
    layers = list(learner.module.decoder.layers)
    total = len(layers)

    def forward_hook(index: int, _module: Any, _inputs: Any, output: Any) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        progress(f"{'recompute' if in_backward else 'forward'} layer {index + 1}/{total}")
        hidden = output[0] if isinstance(output, tuple) else output
        if not in_backward and hidden.requires_grad:
            hidden.register_hook(lambda _grad: progress(f"backward layer {index + 1}/{total}"))

    handles = [
        layer.register_forward_hook(functools.partial(forward_hook, index))
        for index, layer in enumerate(layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
