"""This pipeline stage's megatron parameters, in any TP/EP/ETP layout, as full HF tensors.

Only the stage's sending rank needs the full tensors, so the shards it lacks are sent to it
point to point (weights/plan.py says which rank holds which): for each bucket, every rank of
the sender's groups posts, at once, one send per shard of the bucket's window and the sender
one receive per shard, then they wait. Posting a bucket's messages together is what makes
this fast: one all_gather per parameter, waited one after the other, moved ~0.2 GB/s on gloo
(tools/bench_weight_sync.py); and no rank but the sender receives anything.

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
from megatron_fr.convert.shard import unshard_tensor
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
            _exchange(plan, bucket.window, params)
        return
    waiting: dict[str, Tensor] = {}  # HF tensors of fetched megatron tensors, until their bucket
    for bucket in plan.buckets:
        fetched = _exchange(plan, bucket.window, params)[::-1]
        for full in bucket.window:  # each tensor's received shards are freed once it is whole
            tensor = unshard_tensor(fetched.pop(), params[full.param], full.name)
            waiting.update(megatron_tensor_to_hf(spec, full.name, tensor, plan.names))
            del tensor
        yield [(name, waiting.pop(name)) for name in bucket.names]


def _exchange(plan: ReshardPlan, window: tuple[FullTensor, ...], params: dict) -> list:
    """Post every send (or, on the sender, receive) of the window's shards, then wait for
    all. On the sender: each tensor's shards (its own, received ones); elsewhere []."""
    ops: dict[bool, list[dist.P2POp]] = {False: [], True: []}  # by group: dense, expert
    shards = []
    for full in window:
        local, group = params[full.param].detach(), plan.group_of(full)
        if plan.is_sender:
            pieces = [
                local if rank == plan.rank else torch.empty_like(local) for rank in full.holders
            ]
            for rank, piece in zip(full.holders, pieces, strict=True):
                if rank != plan.rank:
                    ops[full.expert].append(dist.P2POp(dist.irecv, piece, rank, group))
            shards.append(pieces)
        elif group is not None and plan.rank in full.holders:
            ops[full.expert].append(dist.P2POp(dist.isend, local.contiguous(), plan.sender, group))
    works = [work for batch in ops.values() if batch for work in dist.batch_isend_irecv(batch)]
    for work in works:
        work.wait()
    return shards


def iter_hf_buckets(
    model: torch.nn.Module, spec: HFModelSpec, bucket_bytes: int = 512 * 2**20
) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of at most bucket_bytes (a bigger tensor goes
    alone), on its sender (build_plan, then reshard_buckets)."""
    yield from reshard_buckets(model, build_plan(model, spec, bucket_bytes), spec)
