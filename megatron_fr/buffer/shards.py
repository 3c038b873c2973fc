"""Some trajectories of a batch as a few flat tensors: what one data-parallel share of the
learner receives each step, instead of the whole batch on every rank.

    shard = pack_shard(batch, indices, routing_layers)   # on the rollout side
    send_shard(group, shard, dst)  ─►  recv_shard(group, src)        # point to point
    broadcast_shard(group, shard or None, src)                       # within a replica
    rows = shard.rows()            # {batch index: TokenRow} for micro_batches_for_rank

On the wire a shard is a header (11 int64: counts, routing layout, dtype codes) followed by its
tensors: batch indices [n] and token offsets [n + 1] (int64), token ids [N] (int32), action
mask [N] (bool), behaviour log-probs [N] (float32) and, with routing replay, the routed experts
[N - n, layers, top_k] (uint8 or int16) of the layers the receiver's pipeline stage holds and,
for the top-K gate, the engine's top-K ids (int32) and log-probs (float32) [policy tokens, K]:
13 bytes a token plus layers x top_k bytes of routing (384 for Qwen3-30B-A3B, 48 x top-8) plus
K x 8 bytes a policy token with the top-K gate. The
receiver allocates exactly what the header announces, so no pickling and no Python object per
token is involved. The senders and receivers must agree on the groups; the header also checks
the message format version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs

FORMAT = 1
_ROUTING_DTYPES = {0: None, 1: torch.uint8, 2: torch.int16}
_HEADER = 11


class PointToPoint(Protocol):
    """A group of ranks that sends and receives tensor lists by local rank: torch's gloo
    backend object (dist.ProcessGroupGloo), which the data group is, not a group of the
    default world."""

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[Tensor], src: int, tag: int) -> dist.Work: ...


@dataclass(frozen=True)
class TokenRowView:
    """One trajectory of a shard: the fields micro-batches read (micro_batches.TokenRow)."""

    token_ids: np.ndarray
    action_mask: np.ndarray
    behavior_log_probs: np.ndarray
    routed_experts: RoutedExperts | None
    top_logprobs: TopLogProbs | None

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class TrajectoryShard:
    indices: Tensor
    """int64 [n]: each trajectory's index in the batch."""
    offsets: Tensor
    """int64 [n + 1]: trajectory i's tokens are [offsets[i], offsets[i + 1])."""
    token_ids: Tensor
    action_mask: Tensor
    behavior_log_probs: Tensor
    routing: Tensor | None = None
    """[N - n, layers, top_k]: trajectory i's positions (its length - 1) in its order."""
    num_experts: int = 0
    topk_ids: Tensor | None = None
    """int32 [policy tokens, K]: the engine's top-K ids of every policy token, in order."""
    topk_log_probs: Tensor | None = None
    """float32 [policy tokens, K]: their log-probs."""

    @property
    def nbytes(self) -> int:
        """What the shard is on the wire: its header and its tensors."""
        return _HEADER * 8 + sum(t.numel() * t.element_size() for t in _tensors(self))

    def rows(self) -> dict[int, TokenRowView]:
        """Each trajectory's fields as views into the shard, by batch index."""
        out, position, policy = {}, 0, 0
        offsets = self.offsets.tolist()
        for k, index in enumerate(self.indices.tolist()):
            start, end = offsets[k], offsets[k + 1]
            mask = self.action_mask[start:end].numpy()
            routed, top = None, None
            if self.routing is not None:
                experts = self.routing[position : position + end - start - 1].numpy()
                routed = RoutedExperts(experts, self.num_experts)
                position += end - start - 1
            if self.topk_ids is not None and self.topk_log_probs is not None:
                span = slice(policy, policy + int(mask.sum()))
                top = TopLogProbs(self.topk_ids[span].numpy(), self.topk_log_probs[span].numpy())
                policy = span.stop
            out[index] = TokenRowView(
                self.token_ids[start:end].numpy(),
                mask,
                self.behavior_log_probs[start:end].numpy(),
                routed,
                top,
            )
        return out


def pack_shard(
    batch: Sequence[Trajectory],
    indices: Sequence[int],
    routing_layers: slice | None = None,
) -> TrajectoryShard:
    """The trajectories `indices` of `batch`; with routing_layers, their routed experts of
    those layers (a pipeline stage's); their engine top-K records when all of them have one
    (the top-K gate's; the learner checks each trajectory has one, of its K)."""
    chosen = [batch[i] for i in indices]
    lengths = [t.length for t in chosen]
    routing, num_experts = None, 0
    if routing_layers is not None:  # every trajectory has them (routing replay checked)
        records = [t.routed_experts for t in chosen if t.routed_experts is not None]
        routing = torch.from_numpy(np.concatenate([r.experts[:, routing_layers] for r in records]))
        num_experts = records[0].num_experts
    tops = [t.top_logprobs for t in chosen if t.top_logprobs is not None]
    topk_ids = topk_log_probs = None
    if tops and len(tops) == len(chosen):
        topk_ids = torch.from_numpy(np.concatenate([top.ids for top in tops]))
        topk_log_probs = torch.from_numpy(np.concatenate([top.log_probs for top in tops]))
    return TrajectoryShard(
        indices=torch.tensor(list(indices), dtype=torch.int64),
        offsets=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        token_ids=torch.from_numpy(np.concatenate([t.token_ids for t in chosen])),
        action_mask=torch.from_numpy(np.concatenate([t.action_mask for t in chosen])),
        behavior_log_probs=torch.from_numpy(np.concatenate([t.behavior_log_probs for t in chosen])),
        routing=routing,
        num_experts=num_experts,
        topk_ids=topk_ids,
        topk_log_probs=topk_log_probs,
    )


def _header(shard: TrajectoryShard) -> Tensor:
    routing = shard.routing
    code = 0 if routing is None else {torch.uint8: 1, torch.int16: 2}[routing.dtype]
    layers, top_k = (0, 0) if routing is None else tuple(routing.shape[1:])
    return torch.tensor(
        [
            FORMAT,
            shard.indices.numel(),
            shard.token_ids.numel(),
            code,
            layers,
            top_k,
            shard.num_experts,
            0 if routing is None else routing.shape[0],
            *_topk_shape(shard),
            0,
        ],
        dtype=torch.int64,
    )


def _topk_shape(shard: TrajectoryShard) -> tuple[int, int]:
    """(policy tokens, K) of the shard's top-K records; (0, 0) without them."""
    if shard.topk_ids is None:
        return 0, 0
    tokens, k = shard.topk_ids.shape
    return tokens, k


def _tensors(shard: TrajectoryShard) -> list[Tensor]:
    optional = [shard.routing, shard.topk_ids, shard.topk_log_probs]
    parts = [shard.indices, shard.offsets, shard.token_ids, shard.action_mask]
    return parts + [shard.behavior_log_probs] + [t for t in optional if t is not None]


def _empty_like_header(header: Tensor) -> TrajectoryShard:
    fields = header[:10].tolist()
    version, n, tokens, code, layers, top_k, num_experts, positions, policy, k = fields
    if version != FORMAT:
        raise RuntimeError(f"trajectory shard format {version}, expected {FORMAT}")
    dtype = _ROUTING_DTYPES[code]
    return TrajectoryShard(
        indices=torch.empty(n, dtype=torch.int64),
        offsets=torch.empty(n + 1, dtype=torch.int64),
        token_ids=torch.empty(tokens, dtype=torch.int32),
        action_mask=torch.empty(tokens, dtype=torch.bool),
        behavior_log_probs=torch.empty(tokens, dtype=torch.float32),
        routing=None if dtype is None else torch.empty((positions, layers, top_k), dtype=dtype),
        num_experts=num_experts,
        topk_ids=torch.empty((policy, k), dtype=torch.int32) if k else None,
        topk_log_probs=torch.empty((policy, k), dtype=torch.float32) if k else None,
    )


def send_shard(group: PointToPoint, shard: TrajectoryShard, dst: int) -> list:
    """Start sending `shard` to rank `dst` of `group` (a raw ProcessGroup, ranks local to
    it); returns the works to wait on."""
    return [
        group.send([tensor.contiguous()], dst, 0) for tensor in [_header(shard), *_tensors(shard)]
    ]


def recv_shard(group: PointToPoint, src: int) -> TrajectoryShard:
    """The shard rank `src` of `group` sends (send_shard)."""
    header = torch.empty(_HEADER, dtype=torch.int64)
    group.recv([header], src, 0).wait()
    shard = _empty_like_header(header)
    for tensor in _tensors(shard):
        group.recv([tensor], src, 0).wait()
    return shard


def broadcast_shard(
    group: dist.ProcessGroup, shard: TrajectoryShard | None, src: int
) -> TrajectoryShard:
    """`shard` of global rank `src` on every rank of `group` (a torch.distributed group of
    the default world; the others pass None)."""
    header = _header(shard) if shard is not None else torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    received = shard if shard is not None else _empty_like_header(header)
    for tensor in _tensors(received):
        dist.broadcast(tensor, src=src, group=group)
    return received
