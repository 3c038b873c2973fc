"""Where each full HF tensor of a pipeline stage comes from, and which bucket it goes in.

The stage's sending rank (TP 0, DP 0: the first rank of the stage) sends every HF tensor of
the stage; the shards it lacks live on the other ranks of its TP group (dense tensors) and of
its expert-TP x EP group (experts). The plan lists, per full (TP1/EP1) megatron tensor, the
global ranks holding its shards, in shard order, and cuts the HF tensors these map to into
buckets (a bucket closes when the next HF tensor would overflow it; a bigger tensor goes
alone). Each bucket names its *window*: the megatron tensors whose first HF tensor it holds,
fetched when the bucket is built; a tensor whose HF parts straddle two buckets (q/k/v of a
fused QKV) is fetched once, its later parts kept until their bucket.

Every rank of a stage holds the same parameter names and shapes, so every rank computes the
same plan from its own parameters. Ranks outside the sender's groups (other data-parallel
replicas) take no part. Building it is a collective over the expert group (each rank's
expert-TP and EP coordinates); the plan is reused for every sync of a run (weights/sync.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_fr.convert.qwen import MegatronNames, megatron_tensor_to_hf, outer_pairs
from megatron_fr.convert.shard import (
    expert_global_name,
    groups_or_megatron,
    partition_dim,
    stage_layer_numbers,
)
from megatron_fr.models.hf_config import HFModelSpec

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class FullTensor:
    """One full megatron tensor of the stage and the ranks holding its shards."""

    name: str
    """Global megatron name (global layer and expert index)."""
    param: str
    """The local parameter holding a shard of it (the same name on every rank of the stage)."""
    holders: tuple[int, ...]
    """Global ranks holding its shards, in shard order (one rank: it is held whole)."""
    expert: bool
    """Its shards travel over the expert-TP x EP group (else over the TP group)."""


@dataclass(frozen=True)
class BucketPlan:
    window: tuple[FullTensor, ...]
    """The megatron tensors fetched for this bucket (those whose first HF tensor is in it)."""
    names: tuple[str, ...]
    """Its HF tensors, in order."""
    nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    buckets: tuple[BucketPlan, ...]
    names: MegatronNames
    rank: int
    """This rank (global)."""
    sender: int | None
    """The stage's sending rank (global); None where this rank takes no part."""
    dense_group: dist.ProcessGroup | None
    """The TP group, if it is the sender's (this rank then sends its dense shards), else None."""
    expert_group: dist.ProcessGroup | None
    """The expert-TP x EP group, if it is the sender's, else None."""
    bucket_bytes: int
    largest_tensor_bytes: int
    """The largest HF tensor (memory bound: buckets in memory x bucket_bytes + this)."""

    @property
    def is_sender(self) -> bool:
        return self.rank == self.sender

    def group_of(self, full: FullTensor) -> dist.ProcessGroup | None:
        """The group `full`'s shards travel over, or None if this rank takes no part."""
        return self.expert_group if full.expert else self.dense_group


@dataclass(frozen=True)
class _Groups:
    """This rank's view of the groups shards travel over."""

    dense_ranks: list[int]
    expert_ranks: dict[tuple[int, int], int]
    """(expert-TP rank, EP rank) -> global rank, over this rank's expert-TP x EP group."""
    dense_group: dist.ProcessGroup
    expert_group: dist.ProcessGroup | None
    dense_active: bool
    expert_active: bool
    etp: int
    ep: int


def _groups(has_experts: bool, groups: ProcessGroupCollection) -> _Groups:
    dense_group = groups.tp
    tp = dense_group.size()
    dense_ranks = [dist.get_global_rank(dense_group, t) for t in range(tp)]
    etp = groups.expt_tp.size() if has_experts else 1
    ep = groups.ep.size() if has_experts else 1
    expert_group: dist.ProcessGroup | None = None
    expert_ranks: dict[tuple[int, int], int] = {}
    if has_experts:
        expert_group = groups.tp_ep
        mine = (groups.expt_tp.rank(), groups.ep.rank())
        coordinates = [mine] * dist.get_world_size(expert_group)  # all_gather fills each
        dist.all_gather_object(coordinates, mine, group=expert_group)
        expert_ranks = {c: dist.get_global_rank(expert_group, i) for i, c in enumerate(coordinates)}
    return _Groups(
        dense_ranks,
        expert_ranks,
        dense_group,
        expert_group,
        dense_active=groups.dp_cp.rank() == 0,
        expert_active=has_experts and groups.expt_dp.rank() == 0,
        etp=etp,
        ep=ep,
    )


def _full_tensors(
    model: GPTModel, spec: HFModelSpec, groups: _Groups
) -> Iterator[tuple[FullTensor, list[int]]]:
    """(FullTensor, its full shape) for the stage, in parameter order (each expert parameter
    once per EP rank, whose experts it stands for)."""
    layers = dict(enumerate(stage_layer_numbers(model)))
    keep_outer = set(outer_pairs(spec))
    for local_name, param in model.named_parameters():
        name, match = local_name, _LOCAL_LAYER.match(local_name)
        if match:
            name = f"decoder.layers.{layers[int(match.group(1))]}." + name[match.end() :]
        elif name not in keep_outer:
            continue  # the last stage's copy of tied embeddings: sent by the first stage
        expert = ".experts." in name
        sharded = getattr(param, "tensor_model_parallel", False)
        shape = list(param.shape)
        if not expert:
            holders = tuple(groups.dense_ranks if sharded else groups.dense_ranks[:1])
            if len(holders) > 1:
                shape[partition_dim(param)] *= len(holders)
            yield FullTensor(name, local_name, holders, False), shape
            continue
        etp = groups.etp if sharded else 1
        if etp > 1:
            shape[partition_dim(param)] *= etp
        for ep_rank in range(groups.ep):
            holders = tuple(groups.expert_ranks[(t, ep_rank)] for t in range(etp))
            global_name = expert_global_name(name, ep_rank, spec.num_experts // groups.ep)
            yield FullTensor(global_name, local_name, holders, True), shape


def build_plan(
    model: torch.nn.Module,
    spec: HFModelSpec,
    bucket_bytes: int,
    groups: ProcessGroupCollection | None = None,
) -> ReshardPlan:
    """This stage's plan over the learner's process `groups` (megatron's when not given); a
    collective over every rank's expert-TP x EP group."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    params = dict(model.named_parameters())
    has_experts = any(".experts." in name for name in params)
    plan_groups = _groups(has_experts, groups_or_megatron(groups))
    names = MegatronNames.of(params)
    sender = _sender(plan_groups, has_experts)
    buckets: list[BucketPlan] = []
    window: list[FullTensor] = []  # the open bucket's
    hf_names: list[str] = []
    size, largest = 0, 0
    for full, shape in _full_tensors(model, spec, plan_groups):
        meta = torch.empty(shape, dtype=params[full.param].dtype, device="meta")
        for index, (hf_name, tensor) in enumerate(
            megatron_tensor_to_hf(spec, full.name, meta, names).items()
        ):
            nbytes = tensor.numel() * tensor.element_size()
            largest = max(largest, nbytes)
            if hf_names and size + nbytes > bucket_bytes:
                buckets.append(BucketPlan(tuple(window), tuple(hf_names), size))
                window, hf_names, size = [], [], 0
            if index == 0:
                window.append(full)
            hf_names.append(hf_name)
            size += nbytes
    if hf_names:
        buckets.append(BucketPlan(tuple(window), tuple(hf_names), size))
    return ReshardPlan(
        tuple(buckets),
        names,
        dist.get_rank(),
        sender,
        dense_group=plan_groups.dense_group if plan_groups.dense_active else None,
        expert_group=plan_groups.expert_group if plan_groups.expert_active else None,
        bucket_bytes=bucket_bytes,
        largest_tensor_bytes=largest,
    )


def _sender(groups: _Groups, has_experts: bool) -> int | None:
    """The stage's sending rank as this rank's groups see it, None if they are not its.

    It is TP rank 0 of the first data-parallel replica (sync.is_stage_sender); its experts'
    group must be the one of expert-data-parallel rank 0 with it at expert-TP 0 / EP 0, as
    megatron's rank order makes the first rank of a stage (checked on that rank)."""
    if groups.dense_active:
        sender = groups.dense_ranks[0]
        expert_first = groups.expert_ranks.get((0, 0)) if groups.expert_active else None
        if sender == dist.get_rank() and has_experts and expert_first != sender:
            raise ValueError(
                f"weight sync: the stage's sending rank {sender} (TP 0, DP 0) is not expert-TP "
                "0 / EP 0 / expert-DP 0: this rank layout does not put both at the first rank "
                "of the stage"
            )
        return sender
    if groups.expert_active:
        return groups.expert_ranks[(0, 0)]
    return None
