"""Full (TP1/EP1) megatron tensors <-> this rank's shards, the way megatron splits them.

Used to load a converted checkpoint into a model of any TP/EP/ETP layout and, in reverse, by
weight sync. A parameter tagged ``tensor_model_parallel`` is split along ``partition_dim`` into
world * stride chunks and rank r holds every world-th chunk starting at r (stride 2 is how
megatron interleaves [gate; up] of a gated fc1). Experts are split over the expert-tensor-
parallel group, everything else over TP; local expert j on EP rank r is global r * n_local + j.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.weight)(\d+)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_GATED_FC1 = re.compile(r"\.linear_fc1\.(weight|bias)\d*$")


def expert_global_name(name: str, ep_rank: int, num_local: int) -> str:
    """The name of EP rank `ep_rank`'s local expert parameter `name` with its global index."""
    first = ep_rank * num_local
    name = _LOCAL_EXPERT.sub(lambda m: f".local_experts.{first + int(m.group(1))}.", name)
    return _GROUPED_EXPERT.sub(lambda m: f"{m.group(1)}{first + int(m.group(2))}", name)


def groups_or_megatron(groups: ProcessGroupCollection | None) -> ProcessGroupCollection:
    """`groups` (a learner's), else the groups parallel/state.initialize built. Imported here,
    not at the top: the rollout process imports this module and must not import megatron."""
    if groups is not None:
        return groups
    from megatron_fr.parallel.state import process_groups

    return process_groups()


def global_name(name: str, num_experts: int, groups: ProcessGroupCollection | None = None) -> str:
    """The TP1/EP1 name of a parameter (expert indices made global), either layer spec;
    `groups`: the model's process groups (megatron's when not given)."""
    if ".experts." not in name:
        return name
    ep = groups_or_megatron(groups).ep
    return expert_global_name(name, ep.rank(), num_experts // ep.size())


def shard_group(
    name: str, param: torch.nn.Parameter, groups: ProcessGroupCollection | None = None
) -> tuple[int, int] | None:
    """(rank, size) in the group `param` is split over (expert TP for experts, TP otherwise),
    or None when every rank of that group holds it whole."""
    resolved = groups_or_megatron(groups)
    group = resolved.expt_tp if ".experts." in name else resolved.tp
    rank, size = group.rank(), group.size()
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return None
    return rank, size


def partition_stride(name: str, param: torch.nn.Parameter) -> int:
    """How many interleaved parts a shard of `param` holds along its partition dim.

    A gated linear_fc1 (SwiGLU, every supported model) is always [gate part; up part] on each
    rank: megatron's checkpoint code assumes so for dense MLPs and experts alike
    (apply_swiglu_sharded_factory), although transformer-engine's grouped experts mark their
    weights stride 1; so for fc1 the name decides, elsewhere the parameter's own stride."""
    if _GATED_FC1.search(name):
        return 2
    return _own_stride(param)


def _own_stride(param: torch.nn.Parameter) -> int:
    """The stride megatron recorded on the parameter (1 unless it interleaves parts)."""
    return getattr(param, "partition_stride", 1)


def partition_dim(param: torch.nn.Parameter) -> int:
    """The dim megatron splits a tensor-parallel `param` along: an attribute its parallel
    layers set on the parameter (set_tensor_model_parallel_attributes)."""
    dim = getattr(param, "partition_dim", None)
    if not isinstance(dim, int):
        raise ValueError(f"a parameter of shape {tuple(param.shape)} has no partition_dim")
    return dim


def stage_layer_numbers(model: GPTModel) -> list[int]:
    """The global 0-based index of each of this pipeline stage's decoder layers, in module
    order: megatron numbers a stage's layers from 0 and records layer_number (1-based)."""
    return [layer.layer_number - 1 for layer in model.decoder.layers]


def shard_ranges(length: int, size: int, stride: int, rank: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of the full partition dim that `rank`'s shard holds, in order:
    the dim cut into size * stride equal chunks, every size-th one from `rank` on."""
    chunk = length // (size * stride)
    return [(k * chunk, (k + 1) * chunk) for k in range(rank, size * stride, size)]


def shard_tensor(
    full: Tensor,
    name: str,
    param: torch.nn.Parameter,
    groups: ProcessGroupCollection | None = None,
) -> Tensor:
    """This rank's slice of the full tensor for parameter `name`."""
    group = shard_group(name, param, groups)
    if group is None:
        return full
    dim, (rank, size) = partition_dim(param), group
    ranges = shard_ranges(full.shape[dim], size, partition_stride(name, param), rank)
    return torch.cat([full.narrow(dim, start, stop - start) for start, stop in ranges], dim=dim)


def unshard_tensor(
    shards: list[Tensor], param: torch.nn.Parameter, name: str | None = None
) -> Tensor:
    """The full tensor from every rank's shard (rank order): the inverse of shard_tensor.
    Pass the parameter's `name` so that a gated fc1's layout is known (partition_stride)."""
    if len(shards) == 1 or not getattr(param, "tensor_model_parallel", False):
        return shards[0]
    dim = partition_dim(param)
    stride = _own_stride(param) if name is None else partition_stride(name, param)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def global_parameter_names(
    model: GPTModel, num_experts: int, groups: ProcessGroupCollection | None = None
) -> dict[str, str]:
    """This rank's parameter names -> their TP1/EP1/PP1 names: the global layer index on any
    pipeline stage (megatron numbers a stage's layers from 0 and records layer_number) and
    the global expert index."""
    groups = groups_or_megatron(groups)
    offsets = {str(i): str(number) for i, number in enumerate(stage_layer_numbers(model))}
    names = {}
    for name, _ in model.named_parameters():
        full = global_name(name, num_experts, groups)
        match = _LAYER.match(full)
        if match:
            full = f"decoder.layers.{offsets[match.group(1)]}.{full[match.end() :]}"
        names[name] = full
    return names


def load_full_state(
    model: torch.nn.Module,
    full: dict[str, Tensor],
    num_experts: int,
    groups: ProcessGroupCollection | None = None,
) -> None:
    """Copy each of this rank's parameters from the full (TP1/EP1) tensors, by global name."""
    groups = groups_or_megatron(groups)
    with torch.no_grad():
        for name, param in model.named_parameters():
            source_name = global_name(name, num_experts, groups)
            source = full.get(source_name)
            if source is None:
                raise KeyError(f"no tensor {source_name!r} for {name!r}")
            param.copy_(shard_tensor(source, name, param, groups))
