"""A batch of B trajectories -> this data-parallel rank's micro-batches for one optimizer step.

Every rank sees the whole batch (the controller broadcasts it) and takes its share by a
deterministic rule, so no coordination is needed:
  - trajectories are dealt to DP ranks longest first, each to the rank with the fewest
    tokens so far (balanced work);
  - a micro-batch is `rows` right-padded rows of the same width, rows * width <= the per-rank
    token budget; every rank runs the SAME number of micro-batches of the SAME shape (MoE
    expert-parallel all-to-alls and pipeline stages need their peers in step), padding with
    empty rows (segment -1, no policy token, so they add nothing to the loss).
Each token keeps its trajectory's index in the global batch (segment id), which is what the
parallel loss sums by, so the split needs no other bookkeeping. With routing replay, each
micro-batch also carries the routed experts of its input positions, padded the same way
(learner/routing_replay.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_fr.buffer.trajectory import Trajectory, validate_trajectory
from megatron_fr.learner.routing_replay import micro_batch_routing
from megatron_fr.parallel.loss import LossBatch


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor
    """[rows, width] tokens fed to the model (a trajectory's tokens but its last)."""
    positions: torch.Tensor
    loss_batch: LossBatch
    routing: torch.Tensor | None = None
    """[rows, width, layers, top_k] expert ids of every input position (routing replay);
    None unless asked for."""

    @property
    def policy_tokens(self) -> int:
        return int(self.loss_batch.action_mask.sum())


def deal_to_ranks(lengths: list[int], ranks: int) -> list[list[int]]:
    """Trajectory indices per DP rank: longest first, each to the least-loaded rank."""
    if len(lengths) < ranks:
        raise ValueError(f"a batch of {len(lengths)} trajectories cannot feed {ranks} DP ranks")
    loads, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(share) for share in shares]


def micro_batches_for_rank(
    batch: list[Trajectory],
    *,
    dp_rank: int,
    dp_size: int,
    token_budget: int,
    pad_id: int = 0,
    width_multiple: int = 1,
    routing: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches; the same count and shape on every rank (see module doc).

    width_multiple: the model's sequence length must divide by it (TP with sequence
    parallelism splits the sequence), so widths are rounded up to it. routing: carry the
    trajectories' routed experts (every trajectory has them: RoutingReplay.check).
    """
    for trajectory in batch:
        validate_trajectory(trajectory)
    width = max(t.length for t in batch) - 1
    width = math.ceil(width / width_multiple) * width_multiple
    if width > token_budget:
        raise ValueError(
            f"the longest trajectory needs {width} tokens, over the per-rank token budget "
            f"{token_budget}"
        )
    rows = token_budget // width
    shares = deal_to_ranks([t.length for t in batch], dp_size)
    count = max(math.ceil(len(share) / rows) for share in shares)
    mine = shares[dp_rank]
    return [
        _micro_batch(batch, mine[i * rows : (i + 1) * rows], rows, width, pad_id, routing)
        for i in range(count)
    ]


def _micro_batch(
    batch: list[Trajectory], indices: list[int], rows: int, width: int, pad_id: int, routing: bool
) -> MicroBatch:
    tokens = torch.full((rows, width + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width + 1), dtype=torch.bool)
    behavior = torch.zeros((rows, width + 1), dtype=torch.float32)
    segments = torch.full((rows, width + 1), -1, dtype=torch.long)
    for row, index in enumerate(indices):
        t = batch[index]
        tokens[row, : t.length] = torch.tensor(t.token_ids)
        mask[row, : t.length] = torch.tensor(t.action_mask)
        behavior[row, : t.length] = torch.tensor(t.behavior_log_probs).masked_fill(
            ~mask[row, : t.length], 0.0
        )
        segments[row, : t.length] = index
    # position t of the model's input predicts token t + 1: score targets 1..width
    positions = torch.arange(width).expand(rows, width)
    loss_batch = LossBatch(
        target_ids=tokens[:, 1:],
        behavior_log_probs=behavior[:, 1:],
        action_mask=mask[:, 1:],
        segment_ids=segments[:, 1:],
        positions=positions,
    )
    routed = micro_batch_routing(batch, indices, rows, width) if routing else None
    return MicroBatch(tokens[:, :-1], positions, loss_batch, routed)
