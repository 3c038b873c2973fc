"""Load an HF safetensors checkpoint straight into this rank's megatron parameters.

Every rank of a job calls ``load_hf_into_model`` after building its model stage, and reads
from the HF files only what its own parameters hold: its TP / expert-TP shard, its EP ranks'
experts, its pipeline stage's layers. All ranks read at once, so a run can start from an HF
directory with no offline conversion (the megatron dist checkpoint remains the resume format).

Per parameter: its global megatron name (stage layer offset, global expert index) -> the HF
row ranges that concatenate to the full tensor (``qwen.hf_row_sources``) -> the part of them
this rank's shard covers (megatron's split: ``shard.shard_ranges``) -> positioned reads
straight into the parameter; a staging buffer is used only when the dtype differs, the
parameter is not in host memory, or the shard is a column range (row-parallel linears).
Memory: the model plus one tensor in flight. Names and shapes are checked on every rank, and
the verdict agreed between ranks, before any tensor data is read.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_fr.convert.qwen import MegatronNames, hf_row_sources, hf_tensor_names
from megatron_fr.convert.shard import (
    global_parameter_names,
    groups_or_megatron,
    partition_dim,
    partition_stride,
    shard_group,
    shard_ranges,
)
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.utils.hf_checkpoint import HFCheckpointReader

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded."""

    tensors: int
    """Parameters of this rank filled from the checkpoint."""
    bytes_read: int
    """Bytes read from the files (column shards read whole rows, so can exceed the shard)."""
    seconds: float


@dataclass(frozen=True)
class _Rows:
    """qwen.HFRows with its row count known (a whole tensor's from the parameter's shape)."""

    name: str
    start: int
    count: int


@dataclass(frozen=True)
class _Plan:
    """How one parameter of this rank is read: its HF sources and the part it holds."""

    name: str
    param: torch.nn.Parameter
    sources: list[_Rows]
    dim: int
    """The partition dim (0 when the parameter is not split)."""
    full_shape: tuple[int, ...]
    ranges: list[tuple[int, int]]
    """[start, stop) ranges of the full tensor's `dim` this rank holds, in order."""


def _plan(
    name: str,
    param: torch.nn.Parameter,
    global_name: str,
    spec: HFModelSpec,
    names: MegatronNames,
    groups: ProcessGroupCollection,
) -> _Plan:
    group = shard_group(name, param, groups)
    dim = 0 if group is None else partition_dim(param)
    shape = list(param.shape)
    if group is None:
        ranges = [(0, shape[0])]
    else:
        rank, size = group
        shape[dim] *= size
        ranges = shard_ranges(shape[dim], size, partition_stride(name, param), rank)
    sources = [  # only a lone source, a whole tensor, has no count
        _Rows(rows.name, rows.start, shape[0] if rows.count is None else rows.count)
        for rows in hf_row_sources(spec, global_name, names)
    ]
    if dim != 0 and len(sources) > 1:
        raise NotImplementedError(f"{global_name}: a fused tensor split along dim {dim}")
    return _Plan(name, param, sources, dim, tuple(shape), ranges)


def _expected_hf_shapes(plans: list[_Plan]) -> dict[str, tuple[int, ...]]:
    """HF name -> the shape the built model implies (rows summed over the pieces using it)."""
    rows: dict[str, int] = {}
    trailing: dict[str, tuple[int, ...]] = {}
    for plan in plans:
        for piece in plan.sources:
            rows[piece.name] = rows.get(piece.name, 0) + piece.count
            trailing[piece.name] = plan.full_shape[1:]
    return {name: (rows[name], *trailing[name]) for name in rows}


def _check(reader: HFCheckpointReader, spec: HFModelSpec, plans: list[_Plan]) -> str | None:
    """Names against the config, shapes against this rank's model; the fault, or None."""
    missing = sorted(hf_tensor_names(spec) - reader.tensors.keys())
    extra = sorted(reader.tensors.keys() - hf_tensor_names(spec))
    if missing or extra:
        return (
            f"{reader.directory} does not match its config.json: missing tensors {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected tensors {extra[:8]}"
            f"{' ...' if len(extra) > 8 else ''}"
        )
    for name, shape in _expected_hf_shapes(plans).items():
        found = reader.tensors[name].shape
        if found != shape:
            return f"{name}: shape {list(found)} in the checkpoint, {list(shape)} from config.json"
    return None


def agree_on_errors(error: str | None) -> None:
    """Raise ValueError on every rank if any rank found a fault (a collective of the default
    group when several ranks run): a rank that raised alone would leave the others waiting
    in their next collective."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    for rank, message in enumerate(errors):
        if message is not None:
            where = "" if len(errors) == 1 else f" (found on rank {rank})"
            raise ValueError(f"{message}{where}")


def _read_rows(reader: HFCheckpointReader, plan: _Plan, dest: torch.Tensor) -> None:
    cursor = 0
    for start, stop in plan.ranges:
        offset = 0
        for piece in plan.sources:
            low, high = max(start, offset), min(stop, offset + piece.count)
            if low < high:
                file, entry = reader.file(piece.name)
                first = piece.start + low - offset
                file.read_rows(entry, first, first + high - low, dest[cursor : cursor + high - low])
                cursor += high - low
            offset += piece.count


def _read_columns(reader: HFCheckpointReader, plan: _Plan, dest: torch.Tensor) -> None:
    file, entry = reader.file(plan.sources[0].name)
    cursor = 0
    for start, stop in plan.ranges:
        file.read_columns(entry, start, stop, dest[:, cursor : cursor + stop - start])
        cursor += stop - start


def _load(reader: HFCheckpointReader, plan: _Plan) -> None:
    param = plan.param.data
    in_place = param.device.type == "cpu" and param.is_contiguous()
    dest = param if in_place else torch.empty(param.shape, dtype=param.dtype)
    (_read_rows if plan.dim == 0 else _read_columns)(reader, plan, dest)
    if not in_place:
        param.copy_(dest)


def check_hf_dir(
    model: torch.nn.Module,
    hf_dir: str | Path,
    spec: HFModelSpec,
    groups: ProcessGroupCollection | None = None,
) -> None:
    """load_hf_into_model's check alone: the checkpoint's tensor names against the config and
    their shapes against this rank's shards, from the files' headers (no tensor data is read);
    ValueError on every rank naming the first fault."""
    with HFCheckpointReader(hf_dir) as reader:
        _checked_plans(model, reader, spec, groups_or_megatron(groups))


def _checked_plans(
    model: torch.nn.Module,
    reader: HFCheckpointReader,
    spec: HFModelSpec,
    groups: ProcessGroupCollection,
) -> list[_Plan]:
    """What to read for every parameter of the model, once the checkpoint is checked."""
    names = dict(model.named_parameters())
    layout = MegatronNames.of(names)
    global_names = global_parameter_names(model, spec.num_experts, groups)
    plans = [_plan(n, p, global_names[n], spec, layout, groups) for n, p in names.items()]
    agree_on_errors(_check(reader, spec, plans))
    return plans


def load_hf_into_model(
    model: torch.nn.Module,
    hf_dir: str | Path,
    spec: HFModelSpec,
    *,
    progress: bool = True,
    groups: ProcessGroupCollection | None = None,
) -> LoadReport:
    """Fill every parameter of this rank's GPTModel stage (built by models.gpt.build_gpt_model
    from `spec`, any TP/EP/ETP/PP layout, either layer spec, over the process `groups`:
    megatron's when not given) from the HF directory `hf_dir`.

    Every rank of the job must call it (the check verdict is agreed with one collective).
    Raises ValueError, on every rank and before reading tensor data, when the checkpoint's
    names or shapes do not match `spec` and the model.
    """
    started = time.monotonic()
    with HFCheckpointReader(hf_dir) as reader:
        plans = _checked_plans(model, reader, spec, groups_or_megatron(groups))
        total = sum(p.param.numel() * p.param.element_size() for p in plans)
        show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
        with (
            torch.no_grad(),
            tqdm(
                total=total,
                desc="hf -> model",
                unit="B",
                unit_scale=True,
                file=sys.stderr,
                disable=not show,
            ) as bar,
        ):
            for plan in plans:
                _load(reader, plan)
                bar.update(plan.param.numel() * plan.param.element_size())
        bytes_read = reader.bytes_read
    return LoadReport(len(plans), bytes_read, time.monotonic() - started)
