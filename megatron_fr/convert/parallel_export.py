"""Write a job's model (any TP/EP/ETP/PP layout) as an HF checkpoint directory, all ranks at once.

Each parameter is written by one rank. A split parameter is gathered (to that rank only, not
to all) in its tensor- or expert-tensor-parallel group, whose ranks take the parameters in
turn so that they share the writing; expert-parallel ranks write their own experts and
pipeline stages their own layers, so nothing else moves between ranks; data-parallel replicas
write nothing. A writing rank turns its tensors into HF tensors (``qwen.megatron_tensor_to_hf``)
and appends them to its own files (``rank0000R-0000I.safetensors``). At the end rank 0 numbers
every rank's files ``model-0000i-of-0000N`` in rank order, writes
``model.safetensors.index.json``, ``config.json`` and the tokenizer files, and renames the
directory into place: it appears complete or not at all.

Memory per rank: the model, one gathered parameter and one output shard (max_shard_bytes).
"""

from __future__ import annotations

import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from megatron_fr.convert.hf_files import (
    WEIGHT_SUFFIXES,
    ShardedSafetensorsWriter,
    WrittenShard,
    finalize_shards,
)
from megatron_fr.convert.parallel_load import agree_on_errors
from megatron_fr.convert.qwen import MegatronNames, megatron_tensor_to_hf
from megatron_fr.convert.shard import (
    global_parameter_names,
    groups_or_megatron,
    shard_group,
    unshard_tensor,
)
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.utils.atomic_dir import atomic_directory

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class ExportReport:
    """What this rank wrote."""

    tensors: int
    bytes: int
    seconds: float


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _exchange(value: object) -> list:
    """Every rank's value, in rank order (a collective when several ranks run)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _writes_replica(name: str, groups: ProcessGroupCollection) -> bool:
    """Whether this rank's data-parallel replica of `name` is the one written."""
    if ".experts." in name:
        return groups.expt_dp.rank() == 0
    return groups.dp_cp.rank() == 0


def _assemble(
    index: int, name: str, param: torch.nn.Parameter, groups: ProcessGroupCollection
) -> torch.Tensor | None:
    """The full tensor of `param` on the rank of its (expert-)TP group that writes it (the
    index-th parameter goes to group rank index % size); None on the others."""
    group = groups.expt_tp if ".experts." in name else groups.tp
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    owner = index % size
    if shard_group(name, param, groups) is None:
        return param.detach() if rank == owner else None
    shards = [torch.empty_like(param) for _ in range(size)] if rank == owner else None
    dst = dist.get_global_rank(group, owner)
    dist.gather(param.detach().contiguous(), shards, dst=dst, group=group)
    return None if shards is None else unshard_tensor(shards, param, name)


@dataclass(frozen=True)
class _Target:
    """Where and how the export is written (export_hf_from_model's arguments)."""

    out: Path
    config_text: str
    files_from: Path | None
    max_shard_bytes: int
    dtype: torch.dtype | None
    progress: bool
    groups: ProcessGroupCollection


def _write_part(
    model: torch.nn.Module, spec: HFModelSpec, writer: ShardedSafetensorsWriter, target: _Target
) -> tuple[list[WrittenShard], str | None]:
    """This rank's share of the HF tensors, into its own files. Takes part in every gather
    even after a write failed (peers wait on them); returns (files, the first fault)."""
    names = dict(model.named_parameters())
    layout = MegatronNames.of(names)
    global_names = global_parameter_names(model, spec.num_experts, target.groups)
    fault = None
    bar = tqdm(
        total=len(names),
        desc="model -> hf",
        unit="tensor",
        file=sys.stderr,
        disable=not target.progress or _rank() != 0,
    )
    with bar, torch.no_grad():
        for index, (name, param) in enumerate(names.items()):
            bar.update()
            full_name = global_names[name]
            if full_name == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the last stage's copy of tied embeddings: the first stage writes it
            if not _writes_replica(name, target.groups):
                continue
            full = _assemble(index, name, param, target.groups)
            if full is None or fault is not None:
                continue
            try:
                for hf_name, tensor in megatron_tensor_to_hf(spec, full_name, full, layout).items():
                    writer.add(hf_name, tensor.to("cpu", dtype=target.dtype or tensor.dtype))
            except Exception as error:  # reported to every rank, then raised
                fault = f"rank {_rank()}: writing {full_name} failed: {error!r}"
    try:
        return writer.close(), fault
    except Exception as error:  # likewise
        return [], fault or f"rank {_rank()}: writing its last file failed: {error!r}"


def copy_non_weight_files(source: Path, destination: Path) -> None:
    """Tokenizer, generation config and the like; weights, indexes and config.json excluded."""
    for path in source.iterdir():
        skip = path.name.endswith((*WEIGHT_SUFFIXES, ".index.json")) or path.name == "config.json"
        if path.is_file() and not skip:
            shutil.copy2(path, destination / path.name)


def _finish(partial: Path, shards: list[WrittenShard], target: _Target) -> None:
    finalize_shards(partial, shards)
    (partial / "config.json").write_text(target.config_text)
    if target.files_from is not None:
        copy_non_weight_files(target.files_from, partial)


def export_hf_from_model(
    model: torch.nn.Module,
    spec: HFModelSpec,
    out: str | Path,
    *,
    config_text: str,
    files_from: str | Path | None = None,
    max_shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    groups: ProcessGroupCollection | None = None,
) -> ExportReport:
    """Write this job's model as the HF checkpoint directory `out` (must not exist).

    Every rank calls it (`groups`: the model's process groups, megatron's when not given).
    `config_text` becomes config.json; `files_from` (an HF directory) gives the tokenizer and
    generation files; `dtype` casts the weights (default: as held). Raises on every rank,
    leaving nothing at `out`, if any rank fails.
    """
    started = time.monotonic()
    target = _Target(
        Path(out),
        config_text,
        Path(files_from) if files_from else None,
        max_shard_bytes,
        dtype,
        progress,
        groups_or_megatron(groups),
    )
    directory = ExitStack()  # rank 0 holds the partial directory open in it
    try:
        writer = _write_into(directory, model, spec, target)
    except BaseException:
        directory.__exit__(*sys.exc_info())  # removes the partial directory
        raise
    fault = None
    try:
        directory.close()  # rank 0: the rename into place
    except OSError as error:
        fault = f"rank 0: {error}"
    agree_on_errors(_exchange(fault)[0])
    return ExportReport(writer.tensor_count, writer.total_bytes, time.monotonic() - started)


def _write_into(
    directory: ExitStack, model: torch.nn.Module, spec: HFModelSpec, target: _Target
) -> ShardedSafetensorsWriter:
    """Every step before the final rename, the verdict agreed between ranks after each."""
    partial, fault = None, None
    if _rank() == 0:
        try:
            partial = directory.enter_context(atomic_directory(target.out))
        except OSError as error:
            fault = str(error)
    partial, fault = _exchange((partial, fault))[0]
    agree_on_errors(fault)
    writer = ShardedSafetensorsWriter(partial, target.max_shard_bytes, prefix=f"rank{_rank():05d}")
    shards, fault = _write_part(model, spec, writer, target)
    everyone = _exchange((shards, fault))
    agree_on_errors(next((f for _, f in everyone if f is not None), None))
    if _rank() == 0:
        try:
            _finish(partial, [shard for files, _ in everyone for shard in files], target)
        except OSError as error:
            fault = f"rank 0: finishing {target.out} failed: {error!r}"
    agree_on_errors(_exchange(fault)[0])
    return writer
