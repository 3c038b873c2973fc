"""The one wrapper around torch.distributed + megatron's parallel_state.

``initialize(ParallelConfig)`` is the only place the process groups are created: it starts
torch.distributed from the usual environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as
torchrun and srun launchers set them) unless already started, validates the layout against
the world size and builds megatron's groups. Without CUDA, megatron also needs the CPU shims,
which the program installs at its entry point (parallel/cpu_shims.py); initialize refuses to
go on without them. ``process_groups()`` hands the groups to the code that uses them
(megatron's ProcessGroupCollection), so that nothing else reads parallel_state's globals.
"""

from __future__ import annotations

import datetime
import importlib
import threading
from collections.abc import Callable
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.parallel.cpu_shims import check_installed

T = TypeVar("T")


def resolve_backend(config: ParallelConfig) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def initialize(config: ParallelConfig, seed: int | None = 1234) -> None:
    """Start torch.distributed (if needed) and megatron's model-parallel groups for `config`.

    Raises ValueError, before any group is built, when the layout does not fit the world size.
    """
    if not dist.is_initialized():
        dist.init_process_group(
            backend=resolve_backend(config),
            timeout=datetime.timedelta(minutes=config.timeout_minutes),
        )
    config.validate_world(dist.get_world_size())
    check_installed()
    use_current_collectives()
    if torch.cuda.is_available():
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor,
        pipeline_model_parallel_size=config.pipeline,
        context_parallel_size=config.context,
        expert_model_parallel_size=config.expert,
        expert_tensor_parallel_size=config.effective_expert_tensor,
        distributed_timeout_minutes=config.timeout_minutes,
        # nothing here reads megatron's gloo copies of the groups (the learner's optimizer
        # is built without them), and a fake store (a rehearsal) cannot build them
        create_gloo_process_groups=False,
    )
    if seed is not None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        # megatron initialises some weights (router, norms) from the default generator and
        # others from its tracked model-parallel states: seed both, as megatron's training does.
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)


def process_groups() -> ProcessGroupCollection:
    """megatron's ProcessGroupCollection of every group ``initialize`` built: what the learner
    and megatron's model, DDP, optimizer and schedules are given instead of reading
    parallel_state's globals."""
    return ProcessGroupCollection.use_mpu_process_groups()


MEGATRON_COLLECTIVES = (
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.utils",
)
"""Modules of megatron-core 0.19.2 that bind torch's collectives to dist_all_gather_func and
dist_reduce_scatter_func at import."""


def use_current_collectives() -> None:
    """Point megatron's bound collectives at the functions torch names as their replacements.

    megatron-core binds torch.distributed.all_gather_into_tensor and reduce_scatter_tensor,
    which torch 2.13 deprecates: each call warns (a FutureWarning at every step's gradient
    reduce-scatter). The deprecated functions are wrappers that call all_gather_single and
    reduce_scatter_single with the same arguments, so calling those directly changes no
    collective and no bit. A name megatron bound to anything else (its fp32-accumulating
    reduce-scatter) is left as it is; installing twice changes nothing."""
    replacements = {
        "dist_all_gather_func": (dist.all_gather_into_tensor, dist.all_gather_single),
        "dist_reduce_scatter_func": (dist.reduce_scatter_tensor, dist.reduce_scatter_single),
    }
    for name in MEGATRON_COLLECTIVES:
        module = importlib.import_module(name)
        for attribute, (deprecated, current) in replacements.items():
            if getattr(module, attribute, None) is deprecated:
                setattr(module, attribute, current)


def initialize_single_process(
    config: ParallelConfig | None = None, seed: int | None = None
) -> None:
    """For tools that run alone (checkpoint conversion): a one-rank gloo group on a free
    loopback port, unless torch.distributed is already running, then ``initialize``."""
    from megatron_fr.utils.net import free_port

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    initialize(config or ParallelConfig(), seed)


def broadcast_from_rank0(value: T | None, group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's value on every rank (any picklable object; a collective of `group`, the
    default group if None). The other ranks' values are not read: they pass None where only
    rank 0 has the value."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return cast(T, box[0])  # rank 0's value, which rank 0 always passes


class FirstRankFailed(RuntimeError):
    """What the other ranks raise when the first rank's work (run_on_rank0, share_from_rank0)
    failed."""


def _failed(error: BaseException) -> tuple[str, str]:
    """The outcome rank 0 broadcasts when its work raised `error`."""
    return ("error", f"{type(error).__name__}: {error}")


def _outcome(received: tuple[str, T]) -> T:
    """A non-first rank's side of rank 0's ("done", value) or ("error", message)."""
    kind, value = received
    if kind == "error":
        raise FirstRankFailed(f"the first rank failed: {value}")
    return value


def share_from_rank0(ask: Callable[[], T] | None, group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's answer to `ask` (the other ranks pass None) on every rank, for a question
    answered at once (a slow one: run_on_rank0). When `ask` raises, the other ranks are told
    first (they raise FirstRankFailed naming the error) and it is raised on rank 0, so no rank
    is left in the broadcast to meet rank 0's exit as a lost connection."""
    if ask is None:
        return _outcome(broadcast_from_rank0(None, group))
    try:
        answer = ask()
    except Exception as error:
        broadcast_from_rank0(_failed(error), group)
        raise
    broadcast_from_rank0(("done", answer), group)
    return answer


def run_on_rank0(
    work: Callable[[], T] | None, slice_s: float, group: dist.ProcessGroup | None = None
) -> T:
    """Rank 0 runs `work` (the other ranks pass None) on a thread while every rank meets in a
    broadcast every `slice_s` seconds, so no rank sits in one collective for as long as the
    work may take (an evaluation, a checkpoint's controller state): the collective timeout
    would kill it. Every rank returns rank 0's result; an error of the work is raised on
    rank 0 as it was, and as FirstRankFailed naming it on the others."""
    outcome: list[tuple[str, object]] = []
    thread = None
    if work is not None:

        def run() -> None:
            try:
                outcome.append(("done", work()))
            except BaseException as error:  # handed to the caller's thread below
                outcome.append(("error", error))

        thread = threading.Thread(target=run, name="first-rank-work", daemon=True)
        thread.start()
    while True:
        status: tuple[str, object] | None = None
        if thread is not None:
            thread.join(slice_s)
            if not thread.is_alive():
                kind, value = outcome[0]
                status = (kind, value) if kind == "done" else _failed(cast(BaseException, value))
        received: tuple[str, object] | None = broadcast_from_rank0(status, group)
        if received is None:
            continue
        if received[0] != "done" and thread is not None:
            raise cast(BaseException, outcome[0][1])
        return cast(T, _outcome(received))


def destroy() -> None:
    """Tear down megatron's groups (the default group is left to its owner)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
