"""Core attention for packed rows (THD) and context parallelism without transformer-engine.

megatron runs packed rows and context parallelism (CP) through TEDotProductAttention only; its
local DotProductAttention refuses both. The learner needs them wherever transformer-engine is
absent (CPU, and GPUs without it), so the local spec's core attention is built here as a
subclass that computes what TE computes:

  * a packed row (qkv_format "thd", [tokens, heads, dim]) is attended as one row
    [tokens, 1, heads, dim] under the block-diagonal causal mask of its cu_seqlens (TE's
    padding_causal: a token sees the earlier tokens of its own sequence);
  * with CP > 1, keys and values are all-gathered over the CP group (backward: their
    gradients reduce-scattered, megatron's gather_from_sequence_parallel_region) and each
    local query attends to the gathered keys under the causal mask of their row positions,
    known from megatron's zigzag split (parallel/context_parallel.py): the algorithm of TE's
    cp_comm_type "all_gather". A padded row (no PackedSeqParams) is one sequence.

Everything around the attention product stays megatron's: THD RoPE restarting at each
sequence, RoPE's CP slicing, the CP split of the rotary tables, the gradient reductions. The
torch spec's attention (models/torch_spec.py) uses the same gather, and in place of the row
mask attends chunk by chunk (models/chunked_attention.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_fr.parallel.context_parallel import segment_of, zigzag_indices

if TYPE_CHECKING:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """megatron's PackedSeqParams with the row's boundaries also on the host, read once per
    micro-batch where the row is built (learner/micro_batches.py): every layer's attention
    (forward, and the recomputation in the backward) reads them here, so no layer copies
    cu_seqlens off the device (a device-to-host sync per layer on a GPU)."""

    row_boundaries: tuple[int, ...] | None = None
    """The padded cu_seqlens as Python ints (the row before the CP split)."""


def row_boundaries(
    query: torch.Tensor, packed_seq_params: PackedSeqParams | None, cp_size: int
) -> list[int]:
    """The row's sequence boundaries before the CP split: the padded cu_seqlens of a packed
    row, or the whole row (this rank's query length x CP) for a padded one. The host copy of
    HostPackedSeqParams when there is one; else the tensor is read, one device-to-host copy
    (a sync on a GPU) per call."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        host = getattr(packed_seq_params, "row_boundaries", None)
        if host is not None:
            return list(host)
        padded = packed_seq_params.cu_seqlens_q_padded
        cu = packed_seq_params.cu_seqlens_q if padded is None else padded
        return [int(b) for b in cu.tolist()]
    return [0, query.size(0) * cp_size]


def row_causal_mask(boundaries: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """[local queries, gathered keys] bool, True where attention is masked (megatron's
    convention): a key of another sequence, or one later in the row than the query."""
    queries = zigzag_indices(boundaries, cp_size, cp_rank)
    keys = torch.cat([zigzag_indices(boundaries, cp_size, r) for r in range(cp_size)])
    other = segment_of(boundaries, queries)[:, None] != segment_of(boundaries, keys)[None, :]
    return other | (keys[None, :] > queries[:, None])


def gather_keys_and_values(
    key: torch.Tensor, value: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every CP rank, in rank order along the sequence (dim 0); their
    gradients are reduce-scattered back in the backward pass."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return tuple(
        gather_from_sequence_parallel_region(x.contiguous(), True, group=group)
        for x in (key, value)
    )


def context_parallel_group(pg_collection: ProcessGroupCollection | None) -> ProcessGroup:
    """The CP group a core attention was built for (megatron's global one if none given)."""
    group = getattr(pg_collection, "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, with packed rows and CP (module docstring)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        if config.context_parallel_size > 1:  # the product itself is CP-agnostic
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        group = context_parallel_group(self.pg_collection)
        if packed_seq_params is None and group.size() == 1:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        if attention_mask is not None:
            raise ValueError("packed rows and CP take their mask from the row layout")
        boundaries = row_boundaries(query, packed_seq_params, group.size())
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        mask = row_causal_mask(boundaries, group.size(), group.rank()).to(query.device)
        if group.size() > 1:
            key, value = gather_keys_and_values(key, value, group)
        return super().forward(query, key, value, mask[None, None], attn_mask_type, attention_bias)
