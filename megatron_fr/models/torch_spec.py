"""The torch layer spec: megatron's local spec with torch's fused kernels where the time goes,
and no transformer-engine.

  attention  TorchAttention: torch.nn.functional.scaled_dot_product_attention (flash or
             memory-efficient kernels on a GPU, GQA without repeating K/V); a packed row
             (THD) through torch.nn.attention.varlen.varlen_attn where this torch has it on
             this device (CUDA); context parallelism with keys and values all-gathered over
             the CP group (models/attention.py) and megatron's zigzag split kept. Packed rows
             without varlen attention and every CP row go through
             models/chunked_attention.py: one causal SDPA per zigzag chunk against its own
             sequence's keys, no [queries x keys] mask.
  experts    megatron's own grouped-MLP module, TEGroupedMLP, whose linear_fc1 / linear_fc2
             are built from builders (transformer/moe/experts.py, GroupedLinearFc1Builder);
             TorchGroupedLinear is such a builder: every local expert's weight is its own
             parameter (weight0, weight1, ...; TE's names), stacked for one
             torch.nn.functional.grouped_mm per linear in the forward and again in the
             backward (the stack is not kept for the backward). With a torch or a device
             that has no grouped_mm for the dtype (CUDA grouped_mm takes bf16 only), one
             matmul per expert instead: the documented slower path.

Everything else (norms, QKV and output projections, router, token dispatch, RoPE, the output
layer) is the local spec's. Checkpoints: TEGroupedMLP writes the same dist-checkpoint keys as
the local spec's SequentialMLP (megatron's design), the other modules are the local spec's,
so a checkpoint written with either spec loads in the other; HF load/export and weight sync
name experts through convert/qwen.py's MegatronNames, which tells grouped experts (weight{e})
from sequential ones by the model's parameter names.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megatron_fr.models.attention import (
    context_parallel_group,
    gather_keys_and_values,
    row_boundaries,
)
from megatron_fr.models.chunked_attention import chunk_layout, chunked_causal_attention

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

VarlenKernel = Callable[..., Any]
"""torch.nn.attention.varlen.varlen_attn: its keywords differ across torch versions, and it
returns one Tensor unless asked for its auxiliary outputs (never here)."""


def _varlen_attention() -> tuple[VarlenKernel | None, set[str]]:
    """torch.nn.attention.varlen.varlen_attn and its signature's keywords (None: absent)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


class TorchAttention(MegatronModule):
    """megatron's core-attention interface (CoreAttentionInterface) on torch's fused kernels
    (module docstring). Query [sq, b, heads, d] and key/value [sk, b, groups, d], or [t, ...]
    for a packed row; returns [sq, b, heads x d] (or [t, heads x d])."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("the torch spec's attention has no dropout (RL keeps it at 0)")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.pg_collection = pg_collection
        self.varlen, self.varlen_keywords = _varlen_attention()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        /,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if attention_bias is not None or attention_mask is not None:
            raise ValueError("the torch spec's attention takes its mask from the row layout")
        group = context_parallel_group(self.pg_collection)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd and group.size() == 1 and self._can_varlen(query):
            return self._varlen(query, key, value, packed_seq_params).flatten(-2)
        if thd:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        boundaries = row_boundaries(query, packed_seq_params, group.size())
        layout = chunk_layout(tuple(boundaries), group.size(), group.rank())
        if group.size() > 1:
            key, value = gather_keys_and_values(key, value, group)
        output = chunked_causal_attention(query, key, value, layout, self.softmax_scale)
        output = output.flatten(-2)
        return output.squeeze(1) if thd else output

    def _can_varlen(self, query: Tensor) -> bool:
        return self.varlen is not None and query.is_cuda and query.dtype != torch.float32

    def _varlen(self, query: Tensor, key: Tensor, value: Tensor, params: PackedSeqParams) -> Tensor:
        """A packed row through torch's variable-length flash attention; keyword names as
        this torch spells them (is_causal, or window_size (-1, 0) from torch 2.11 on; K/V
        repeated per query head where it has no enable_gqa)."""
        cu = params.cu_seqlens_q_padded
        if cu is None:
            cu = params.cu_seqlens_q
        keywords: dict[str, float | bool | tuple[int, int]] = {}
        if "scale" in self.varlen_keywords:
            keywords["scale"] = self.softmax_scale
        if "window_size" in self.varlen_keywords:
            keywords["window_size"] = (-1, 0)
        else:
            keywords["is_causal"] = True
        if query.shape[1] != key.shape[1]:
            if "enable_gqa" in self.varlen_keywords:
                keywords["enable_gqa"] = True
            else:
                repeat = query.shape[1] // key.shape[1]
                key, value = (x.repeat_interleave(repeat, dim=1) for x in (key, value))
        query, key, value = (x.contiguous() for x in (query, key, value))
        cu = cu.to(torch.int32)
        top = params.max_seqlen_q
        assert self.varlen is not None  # _can_varlen
        return self.varlen(query, key, value, cu, cu, top, top, **keywords)


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor, counts: list[int]) -> Tensor:
    """torch's grouped matrix multiply where this torch has one for this device and dtype,
    else one matmul per group (module docstring). 2D a [M, K] x 3D b [G, K, N] -> [M, N]
    (groups of a's rows), or 2D a [K, M] x 2D b [M, N] -> [G, K, N] (groups of M)."""
    kernel = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if kernel is not None and (not a.is_cuda or a.dtype == torch.bfloat16):
        return kernel(a, b, offs=offs)
    starts = [0, *itertools.accumulate(counts)]
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(itertools.pairwise(starts))])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in itertools.pairwise(starts)])


ROW_ALIGNMENT = 8
"""Rows each expert's token group is padded to a multiple of: every group then starts 16
bytes aligned in bf16 (what the grouped GEMM kernels read with, notably the weight gradient's
2D x 2D form; torchtitan pads its token groups the same way)."""


class _GroupedLinearFunction(torch.autograd.Function):
    """y = x_g @ W_g^T for each group g of x's rows, from the per-expert weights (stacked for
    the kernel and again in the backward, never kept); groups padded to ROW_ALIGNMENT rows
    (zero rows: they add nothing to the weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, counts: list[int], *weights: Tensor) -> Tensor:
        padded = [math.ceil(n / ROW_ALIGNMENT) * ROW_ALIGNMENT for n in counts]
        rows = _padded_rows(counts, padded, x.device)
        x_padded = x.new_zeros(sum(padded), x.shape[1]).index_copy_(0, rows, x)
        offs = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=x.device)
        ctx.save_for_backward(x_padded, rows, offs, *weights)
        ctx.padded = padded
        weight = torch.stack(weights).transpose(1, 2)
        return _grouped_mm(x_padded, weight, offs, padded).index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x_padded, rows, offs, *weights = ctx.saved_tensors
        grad_padded = grad.new_zeros(x_padded.shape[0], grad.shape[1]).index_copy_(0, rows, grad)
        grad_x = _grouped_mm(grad_padded, torch.stack(weights), offs, ctx.padded)
        grad_weights = _grouped_mm(grad_padded.t(), x_padded, offs, ctx.padded)  # [E, out, in]
        return grad_x.index_select(0, rows), None, *grad_weights.unbind(0)


def _padded_rows(counts: list[int], padded: list[int], device: torch.device) -> Tensor:
    """Where each row of the unpadded groups lands in the padded ones."""
    padded_starts = itertools.accumulate([0, *padded[:-1]])
    starts = itertools.accumulate([0, *counts[:-1]])
    shifts = [a - b for a, b in zip(padded_starts, starts, strict=True)]
    total = sum(counts)  # output_size: no data-dependent shape (nor a device sync)
    shift = torch.repeat_interleave(torch.tensor(shifts), torch.tensor(counts), output_size=total)
    return (torch.arange(total) + shift).to(device)


class TorchGroupedLinear(MegatronModule):
    """A grouped linear for TEGroupedMLP's linear_fc1 / linear_fc2 builders (megatron's
    GroupedLinearFc1Builder protocol): one weight per local expert, [out, in] split over the
    expert-tensor-parallel group on `partition_dim` (0: fc1, column-parallel; 1: fc2,
    row-parallel), no communication of its own (megatron's token dispatcher gathers and
    scatters over that group for the experts)."""

    partition_dim = 0

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        pg_collection: ProcessGroupCollection,
        name: str | None = None,
    ) -> None:
        from megatron.core.tensor_parallel.layers import (
            _initialize_affine_weight_gpu,
            set_tensor_model_parallel_attributes,
        )

        super().__init__(config=config)
        if bias:
            raise ValueError("the torch spec's grouped experts take no bias (Qwen3 has none)")
        self.pg_collection = pg_collection
        split = pg_collection.expt_tp.size()
        shape = [output_size, input_size]
        shape[self.partition_dim] //= split
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        expert_groups = config.expert_model_parallel_size > 1 or (
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        )
        for index in range(num_local_experts):
            weight = torch.nn.Parameter(
                torch.empty(shape, device=device, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                _initialize_affine_weight_gpu(
                    weight, init_method, self.partition_dim, is_expert=True
                )
            else:
                set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
            # megatron's mark of an expert-DP parameter (an attribute torch does not declare)
            setattr(weight, "allreduce", not expert_groups)  # noqa: B010
            self.register_parameter(f"weight{index}", weight)
        self.num_gemms = num_local_experts

    def forward(self, x: Tensor, tokens_per_expert: list[int], /) -> tuple[Tensor, None]:
        weights = [getattr(self, f"weight{index}") for index in range(self.num_gemms)]
        return _GroupedLinearFunction.apply(x, list(tokens_per_expert), *weights), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (nothing deferred)."""

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Local expert i's weight, and the (empty) extra state megatron's linears keep, under
        the global expert's place in the checkpoint: the keys and shards megatron's
        SequentialMLP (and TE's grouped linear) write, so the specs load each other's."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if metadata is None:
            raise ValueError(
                "TorchGroupedLinear.sharded_state_dict needs metadata['dp_cp_group'] (the "
                "model's sharded_state_dict passes it: call that one)"
            )
        groups = self.pg_collection
        first, total = groups.ep.rank() * self.num_gemms, groups.ep.size() * self.num_gemms
        state: dict[str, Any] = {}
        for index in range(self.num_gemms):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + index, total))
            sub = make_sharded_tensors_for_checkpoint(
                {f"{index}.weight": getattr(self, f"weight{index}"), f"{index}._extra_state": None},
                "",
                {f"{index}.weight": self.partition_dim},
                offsets,
                tp_group=groups.expt_tp,
                dp_cp_group=metadata["dp_cp_group"],
            )
            replace_prefix_for_sharding(sub, f"{index}.", prefix)
            for entry in sub.values():  # replicas along the expert-data-parallel group
                entry.replica_id = (*entry.replica_id[:2], groups.expt_dp.rank())
            state[f"{prefix}weight{index}"] = sub[f"{index}.weight"]
            state[f"{prefix}_extra_state{index}"] = sub[f"{index}._extra_state"]
        return state

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        """The per-expert extra states of sharded_state_dict carry nothing: dropped before
        torch's strict key check."""
        for key in [k for k in state_dict if k.startswith(f"{prefix}_extra_state")]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TorchGroupedRowLinear(TorchGroupedLinear):
    """linear_fc2: the input dimension is split over the expert-tensor-parallel group."""

    partition_dim = 1


def torch_layer_spec(local_spec: ModuleSpec, moe: bool) -> ModuleSpec:
    """The torch spec from megatron's local spec (models/gpt.py builds it): TorchAttention as
    the core attention, and for MoE layers TEGroupedMLP over TorchGroupedLinear experts."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    attention = local_spec.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=TorchAttention)
    submodules = dataclasses.replace(
        local_spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)
    )
    if moe:
        mlp = local_spec.submodules.mlp  # partial(MoELayer, submodules=MoESubmodules(...))
        experts = functools.partial(
            TEGroupedMLP,
            submodules=GroupedMLPSubmodules(
                linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedRowLinear
            ),
        )
        moe_submodules = dataclasses.replace(mlp.keywords["submodules"], experts=experts)
        mlp = functools.partial(
            mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_submodules}
        )
        submodules = dataclasses.replace(submodules, mlp=mlp)
    return dataclasses.replace(local_spec, submodules=submodules)
