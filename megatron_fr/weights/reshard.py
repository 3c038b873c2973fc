"""This pipeline stage's megatron parameters, in any TP/EP/ETP layout, as full HF tensors.

Only the stage's sending rank needs the full tensors, so the shards it lacks are sent to it
point to point (weights/plan.py says which rank holds which): for each bucket, every rank of
the sender's groups posts, at once, one send per shard of the bucket's window and the sender
one receive per shard, then they wait. No rank but the sender receives anything, and a
bucket's messages are in flight together rather than one collective per parameter waited
in turn (tools/bench_weight_sync.py prints the rate; on NCCL a batch is one group call).

On the sender, each full megatron tensor becomes its HF tensor(s) by the mapping of
``convert/qwen.py``: the sender's own whole tensors and the experts it receives are not
copied (an fc1's gate and up are views of it), TP shards are concatenated once. A bucket's
tensors may therefore be views of the live parameters: send them before the next optimizer
step. Extra memory: the bucket being built plus the parts of one tensor held for the next.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fr.convert.qwen import megatron_tensor_to_hf
from megatron_fr.convert.shard import partition_dim, partition_stride, shard_ranges
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.weights.plan import FullTensor, ReshardPlan, build_plan

Bucket = list[tuple[str, Tensor]]


def reshard_buckets(
    model: torch.nn.Module, plan: ReshardPlan, spec: HFModelSpec
) -> Iterator[Bucket]:
    """The stage's HF tensors in the plan's buckets, on the stage's sender; on every other
    rank nothing, after it sent its shards as the sender needed them.

    A collective over the stage: every rank must iterate it to the end, in step.
    """
    params = dict(model.named_parameters())  # the parameters: their sharding attributes
    if not plan.is_sender:
        for bucket in plan.buckets:
            _send_shards(plan, bucket.window, params)
        return
    waiting: dict[str, Tensor] = {}  # HF tensors of fetched megatron tensors, until their bucket
    for bucket in plan.buckets:
        for full, tensor in zip(bucket.window, _gather(plan, bucket.window, params), strict=True):
            waiting.update(megatron_tensor_to_hf(spec, full.name, tensor, plan.names))
        yield [(name, waiting.pop(name)) for name in bucket.names]


def shard_messages(param: torch.nn.Parameter, name: str, holders: int) -> list[Tensor]:
    """The views of this rank's shard of `param` that travel as messages, in order.

    Split along dim 0, each of a shard's `stride` parts is one contiguous block of the full
    tensor (convert/shard.py: shard_ranges), so it travels alone and is received in place;
    split along another dim (a row-parallel weight), the shard travels whole."""
    local = param.detach()
    if holders > 1 and partition_dim(param) == 0:
        return list(local.chunk(partition_stride(name, param), dim=0))
    return [local.contiguous()]


def _send_shards(
    plan: ReshardPlan, window: tuple[FullTensor, ...], params: dict[str, torch.nn.Parameter]
) -> None:
    """A peer of the sender: every message of its shards in the window, then wait."""
    ops: dict[bool, list[dist.P2POp]] = {False: [], True: []}  # by group: dense, expert
    for full in window:
        group = plan.group_of(full)
        if group is not None and plan.rank in full.holders:
            for message in shard_messages(params[full.param], full.name, len(full.holders)):
                ops[full.expert].append(dist.P2POp(dist.isend, message, plan.sender, group))
    _post_and_wait(ops)


def _gather(
    plan: ReshardPlan, window: tuple[FullTensor, ...], params: dict[str, torch.nn.Parameter]
) -> list[Tensor]:
    """The sender: the window's full tensors, all their messages posted at once."""
    ops: dict[bool, list[dist.P2POp]] = {False: [], True: []}  # by group: dense, expert
    copies: list[tuple[Tensor, Tensor]] = []
    fulls = [_receive_into(plan, full, params[full.param], ops, copies) for full in window]
    _post_and_wait(ops)
    for region, part in copies:
        region.copy_(part)
    return fulls


def _receive_into(
    plan: ReshardPlan,
    full: FullTensor,
    param: torch.nn.Parameter,
    ops: dict[bool, list[dist.P2POp]],
    copies: list[tuple[Tensor, Tensor]],
) -> Tensor:
    """One full tensor: the sender's own whole tensor as it is; else a new tensor its shards'
    messages are received into, in place where they land contiguously (else into a buffer,
    copied in after the wait, as the sender's own shard is)."""
    local = param.detach()
    if full.holders == (plan.rank,):
        return local
    count = len(full.holders)
    dim = partition_dim(param) if count > 1 else 0
    stride = partition_stride(full.name, param) if count > 1 else 1
    shape = list(local.shape)
    shape[dim] *= count
    tensor = local.new_empty(shape)
    for index, rank in enumerate(full.holders):
        ranges = shard_ranges(shape[dim], count, stride, index)
        regions = [tensor.narrow(dim, start, stop - start) for start, stop in ranges]
        if rank == plan.rank:
            copies += zip(regions, local.chunk(stride, dim), strict=True)
            continue
        if dim == 0:
            messages = regions  # as shard_messages splits the peer's shard
        else:
            messages = [torch.empty_like(local)]
            copies += zip(regions, messages[0].chunk(stride, dim), strict=True)
        group = plan.group_of(full)
        ops[full.expert] += [dist.P2POp(dist.irecv, m, rank, group) for m in messages]
    return tensor


def _post_and_wait(ops: dict[bool, list[dist.P2POp]]) -> None:
    """Post every message of a window at once (one batch per group, dense before expert on
    every rank), then wait for all."""
    works = [work for batch in ops.values() if batch for work in dist.batch_isend_irecv(batch)]
    for work in works:
        work.wait()


def iter_hf_buckets(
    model: torch.nn.Module, spec: HFModelSpec, bucket_bytes: int = 512 * 2**20
) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of at most bucket_bytes (a bigger tensor goes
    alone), on its sender (build_plan, then reshard_buckets)."""
    yield from reshard_buckets(model, build_plan(model, spec, bucket_bytes), spec)
