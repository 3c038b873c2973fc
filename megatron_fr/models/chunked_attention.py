"""Causal attention of a context-parallel rank's zigzag chunks against the row's keys, with no
[queries x keys] row mask: the torch spec's attention for packed rows and CP.

With CP > 1 a rank holds chunks r and 2 CP - 1 - r of every sequence of its row
(parallel/context_parallel.py) and attends to the keys and values gathered from the whole CP
group. A chunk [a, e) of the sequence that starts at s sees exactly the row's keys [s, e): the
earlier chunks of its sequence whole, its own causally. That is causal attention aligned at
the lower right (query i of the chunk sees the first a - s + i + 1 keys), so each chunk is one
scaled_dot_product_attention call over a span of the keys in row order, and no key of another
sequence or of a later position is scored, stored or masked:

  * per micro-batch, ChunkLayout (cached on the row's boundaries: every layer, and the
    recomputation in the backward, shares it): each chunk's span of the local queries and of
    the row-ordered keys, and the spans of the gathered keys that make those row-ordered keys
    (each sequence's keys up to the end of this rank's last chunk of it);
  * per layer, the gathered keys and values are put in row order (one concatenation of
    views) and each chunk is one SDPA call: a square one (the first chunk of a sequence, or a
    whole sequence at CP 1) with is_causal; a longer key span under torch's lower-right causal
    bias (torch.nn.attention.bias.causal_lower_right), which CUDA's flash and memory-efficient
    kernels apply inside the kernel. Where neither kernel takes the call (the CPU, or a dtype
    they refuse) the bias is a view of one additive lower-right tile, built once on the
    queries' device in their dtype and shared by every layer and chunk: a chunk's bias is the
    tile's lower-right corner of its own shape.

MASKS counts the tiles built and the bytes of those in host memory; tools/bench_attention.py
prints them per micro-batch.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

from megatron_fr.parallel.context_parallel import zigzag_chunks

Span = tuple[int, int]


@dataclass(frozen=True)
class Chunk:
    """One zigzag chunk of this rank: its span of the local queries and the span of the
    row-ordered keys it sees (its sequence's start to its own end)."""

    queries: Span
    keys: Span


@dataclass(frozen=True)
class ChunkLayout:
    """What a micro-batch's attention needs on one CP rank (module docstring)."""

    chunks: tuple[Chunk, ...]
    key_spans: tuple[Span, ...]
    """Spans of the gathered keys (ranks in order, each rank's own chunks in its order) whose
    concatenation is the row-ordered keys the chunks index."""

    tile: Span | None
    """The smallest lower-right tile every non-square chunk's bias is a corner of, (rows,
    columns); None when every chunk is square."""


@functools.lru_cache(maxsize=8)
def chunk_layout(boundaries: tuple[int, ...], cp_size: int, cp_rank: int) -> ChunkLayout:
    """The layout of a row with these sequence boundaries (before the CP split) on `cp_rank`."""
    located: dict[int, tuple[int, int]] = {}  # row span start -> (its end, gathered start)
    gathered = 0
    for rank in range(cp_size):
        for start, end in zigzag_chunks(boundaries, cp_size, rank):
            located[start] = (end, gathered)
            gathered += end - start
    mine = zigzag_chunks(boundaries, cp_size, cp_rank)
    reach: dict[int, int] = {}  # sequence start -> end of this rank's last chunk in it
    for start, end in mine:
        sequence = _sequence_start(boundaries, start)
        reach[sequence] = max(reach.get(sequence, sequence), end)
    key_spans: list[Span] = []
    key_start: dict[int, int] = {}  # sequence start -> its first key in row order
    keys = 0
    for sequence in sorted(reach):
        key_start[sequence], keys = keys, keys + reach[sequence] - sequence
        row = sequence
        while row < reach[sequence]:
            end, at = located[row]
            if key_spans and key_spans[-1][1] == at:  # adjacent in the gathered keys: one view
                key_spans[-1] = (key_spans[-1][0], at + end - row)
            else:
                key_spans.append((at, at + end - row))
            row = end
    chunks, local = [], 0
    for start, end in mine:
        sequence = _sequence_start(boundaries, start)
        first = key_start[sequence]
        chunks.append(Chunk((local, local + end - start), (first, first + end - sequence)))
        local += end - start
    shapes = [(c.queries[1] - c.queries[0], c.keys[1] - c.keys[0]) for c in chunks]
    lower_right = [(rows, cols) for rows, cols in shapes if rows != cols]
    tile = None
    if lower_right:
        tile = max(rows for rows, _ in lower_right), max(cols for _, cols in lower_right)
    return ChunkLayout(tuple(chunks), tuple(key_spans), tile)


def _sequence_start(boundaries: tuple[int, ...], position: int) -> int:
    return boundaries[bisect.bisect_right(boundaries, position) - 1]


def chunked_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: ChunkLayout, scale: float
) -> Tensor:
    """query [local tokens, b, heads, d]; key and value [gathered tokens, b, groups, d] as the
    CP group gathered them (rank order; the local ones at CP 1). Returns [local tokens, b,
    heads, d], each chunk's queries attending causally to their sequence's keys."""
    outputs = []
    for q, k, v, bias in chunk_inputs(query, key, value, layout):
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            is_causal=bias is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outputs.append(out.permute(2, 0, 1, 3))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def chunk_inputs(
    query: Tensor, key: Tensor, value: Tensor, layout: ChunkLayout
) -> list[tuple[Tensor, Tensor, Tensor, Tensor | None]]:
    """What each chunk's SDPA call takes: its queries, keys and values ([b, heads, s, d]
    views, the keys in row order) and its causal bias (None for a square chunk: is_causal)."""
    if layout.key_spans != ((0, key.shape[0]),):
        key, value = (torch.cat([x[s:e] for s, e in layout.key_spans]) for x in (key, value))
    q_all, k_all, v_all = (x.permute(1, 2, 0, 3) for x in (query, key, value))
    inputs = []
    for chunk in layout.chunks:
        (q0, q1), (k0, k1) = chunk.queries, chunk.keys
        q, k, v = q_all[:, :, q0:q1], k_all[:, :, k0:k1], v_all[:, :, k0:k1]
        bias = None if q1 - q0 == k1 - k0 else _lower_right_bias(q, k, v, layout)
        inputs.append((q, k, v, bias))
    return inputs


def _lower_right_bias(q: Tensor, k: Tensor, v: Tensor, layout: ChunkLayout) -> Tensor:
    """torch's lower-right causal bias where a fused kernel applies it (the same test torch's
    CausalBias makes before it would build the mask itself), else the corner of the shared
    tile."""
    params = SDPAParams(q, k, v, None, 0.0, False, q.shape[1] != k.shape[1])
    if can_use_flash_attention(params) or can_use_efficient_attention(params):
        return causal_lower_right(q.shape[2], k.shape[2])
    assert layout.tile is not None  # q is a non-square chunk's
    rows, cols = layout.tile
    return lower_right_tile(rows, cols, q.device, q.dtype)[-q.shape[2] :, -k.shape[2] :]


@dataclass
class MaskCount:
    """Masks the attention has built (tiles), and the bytes of those in host memory."""

    built: int = 0
    host_bytes: int = 0


MASKS = MaskCount()


@functools.lru_cache(maxsize=1)
def lower_right_tile(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[rows, cols] additive bias, -inf where key j is after query i aligned at the lower
    right (j > i + cols - rows), else 0. Any [r <= rows, c <= cols] lower-right corner of it
    is the lower-right causal bias of an r x c chunk."""
    query = torch.arange(rows, device=device)[:, None]
    key = torch.arange(cols, device=device)[None, :]
    tile = torch.zeros(rows, cols, device=device, dtype=dtype)
    tile.masked_fill_(key > query + (cols - rows), float("-inf"))
    MASKS.built += 1
    if tile.device.type == "cpu":
        MASKS.host_bytes += tile.numel() * tile.element_size()
    return tile
