"""Which tokens of a row each context-parallel (CP) rank holds: megatron's zigzag split.

Causal attention makes late tokens dearer than early ones, so megatron cuts every sequence into
2 x CP equal chunks and gives CP rank r chunks r and 2 CP - 1 - r (for CP = 2: chunks 0 and 3
to rank 0, 1 and 2 to rank 1), each rank keeping its chunks in row order. A row that holds one
sequence is split this way as a whole (megatron.core.utils.get_batch_on_this_cp_rank without
cu_seqlens); a packed row is split sequence by sequence, each over its own boundaries
(megatron's per-document balancing, TE's thd_get_partitioned_indices), which is what TE's THD
attention and megatron's THD RoPE (rope_utils._get_thd_freqs_on_this_cp_rank) expect.

The learner splits its rows with it (learner/micro_batches.py), and the attention of the
local and torch layer specs (models/attention.py, models/chunked_attention.py) uses it to know
where each gathered key sits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor


def zigzag_chunks(boundaries: Sequence[int], cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """The row spans [start, end) that CP rank `cp_rank` holds, in its order: chunks r and
    2 CP - 1 - r of each sequence (each whole sequence when cp_size is 1).

    boundaries: the row's sequence boundaries [0, b_1, ..., row width] (cu_seqlens of a packed
    row, or [0, width] for a row of one sequence); every sequence's length must divide by
    2 x cp_size.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is not in [0, {cp_size})")
    bounds = [int(b) for b in boundaries]
    if len(bounds) < 2 or bounds[0] != 0 or any(b >= e for b, e in itertools.pairwise(bounds)):
        raise ValueError(f"boundaries must rise strictly from 0, got {bounds}")
    if cp_size == 1:
        return list(itertools.pairwise(bounds))
    chunks = 2 * cp_size
    spans = []
    for start, end in itertools.pairwise(bounds):
        if (end - start) % chunks:
            raise ValueError(
                f"a sequence of {end - start} tokens (at {start}) cannot be split into "
                f"2 x CP = {chunks} equal chunks"
            )
        size = (end - start) // chunks
        for chunk in (cp_rank, chunks - 1 - cp_rank):
            spans.append((start + chunk * size, start + (chunk + 1) * size))
    return spans


def zigzag_indices(boundaries: Sequence[int], cp_size: int, cp_rank: int) -> Tensor:
    """Row positions (int64, increasing within each sequence) that CP rank `cp_rank` holds:
    zigzag_chunks' spans, position by position."""
    spans = zigzag_chunks(boundaries, cp_size, cp_rank)
    return torch.cat([torch.arange(start, end) for start, end in spans])


def segment_of(boundaries: Sequence[int], indices: Tensor) -> Tensor:
    """The index of the sequence each row position in `indices` belongs to."""
    edges = torch.tensor([int(b) for b in boundaries[1:-1]], dtype=indices.dtype)
    return torch.bucketize(indices, edges.to(indices.device), right=True)
