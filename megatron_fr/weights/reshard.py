"""This pipeline stage's megatron parameters, in any TP/EP/ETP layout, as full HF tensors.

Every rank of the stage walks its parameters in the same order and takes part in the gathers
(TP or expert-TP for the shards, then EP for the experts); each gathered megatron tensor is
turned into its HF tensor(s) by the mapping of ``convert/qwen.py`` and appended to a bucket,
and a bucket is handed out once the next tensor would overflow it. Peak extra memory is
therefore one bucket plus the tensor being converted. Stages produce disjoint HF tensors
(their own layers; the embedding on the first, final norm and untied lm_head on the last),
so each stage can send its part on its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

import megatron_fr.parallel  # noqa: F401  (installs the import shim megatron needs on CPU)
from megatron_fr.convert.qwen import MegatronNames, megatron_tensor_to_hf, outer_pairs
from megatron_fr.convert.shard import expert_global_name, unshard_tensor
from megatron_fr.models.hf_config import HFModelSpec

Bucket = list[tuple[str, Tensor]]
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _all_gather(tensor: Tensor, group, size: int) -> list[Tensor]:
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def _global_layer_names(model) -> dict[int, int]:
    """Local layer index -> global index (megatron numbers layers from 1, across stages)."""
    return {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}


def iter_megatron_full_tensors(model, spec: HFModelSpec) -> Iterator[tuple[str, Tensor]]:
    """(global megatron name, full tensor) for this stage, parameter by parameter."""
    from megatron.core import parallel_state as ps

    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    etp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
    etp = ps.get_expert_tensor_parallel_world_size()
    ep_group, ep = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
    layers = _global_layer_names(model)
    keep_outer = set(outer_pairs(spec))
    for name, param in model.named_parameters():
        match = _LOCAL_LAYER.match(name)
        if match:
            name = f"decoder.layers.{layers[int(match.group(1))]}." + name[match.end() :]
        elif name not in keep_outer:
            continue  # the last stage's copy of tied embeddings: sent by the first stage
        expert = ".experts." in name
        group, size = (etp_group, etp) if expert else (tp_group, tp)
        full = unshard_tensor(_all_gather(param.detach(), group, size), param, name)
        if not expert:
            yield name, full
            continue
        num_local = spec.num_experts // ep
        for ep_rank, tensor in enumerate(_all_gather(full, ep_group, ep)):
            yield expert_global_name(name, ep_rank, num_local), tensor


def iter_hf_tensors(model, spec: HFModelSpec) -> Iterator[tuple[str, Tensor]]:
    names = MegatronNames.of(name for name, _ in model.named_parameters())
    for name, tensor in iter_megatron_full_tensors(model, spec):
        yield from megatron_tensor_to_hf(spec, name, tensor, names).items()


def iter_hf_buckets(model, spec: HFModelSpec, bucket_bytes: int = 512 * 2**20) -> Iterator[Bucket]:
    """This stage's HF tensors in buckets of at most bucket_bytes (a bigger tensor goes alone).

    A collective over the stage: every rank must iterate it to the end, in step.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, tensor in iter_hf_tensors(model, spec):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
