"""A batch of B trajectories -> this rank's micro-batches for one optimizer step.

Every rank sees the whole batch (the controller broadcasts it) and takes its share by a
deterministic rule computed from the trajectory lengths alone (plan_micro_batches), so no
coordination is needed:
  - trajectories are dealt to data-parallel (DP) ranks longest first, each to the rank with
    the fewest tokens so far (balanced work);
  - packed (the default): a micro-batch is ONE row of `width` tokens holding several
    trajectories back to back. Each DP rank packs its share by first-fit decreasing: longest
    first, each trajectory into the first micro-batch it fits in (micro-batches in the order
    they were opened), a new one when none has room. Room is first the token budget, which
    fixes the number of micro-batches (the most any rank needs); it is then narrowed to the
    least that keeps that number, so that the rows carry little padding. A trajectory
    stays whole and attends only to itself: megatron's THD format (PackedSeqParams,
    cu_seqlens = the span boundaries), which TE's attention and torch's varlen attention
    take as they are and the local spec's as a block-diagonal causal mask
    (models/attention.py); RoPE positions restart at 0 in each span (megatron's THD RoPE
    reads cu_seqlens);
  - padded: a micro-batch is `rows` rows of one right-padded trajectory each;
  - every rank runs the SAME number of micro-batches of the SAME shape (MoE expert-parallel
    all-to-alls and pipeline stages need their peers in step), the missing ones being empty
    (segment -1, no policy token: they add nothing to the loss).
A micro-batch holds at most micro_batch_tokens tokens on each CP rank: rows x width <=
micro_batch_tokens x CP before the context-parallel split. A trajectory longer than a row can
be is refused with config/learner.py's longest_row, the rule the layout planner and
`train --check` apply before any process starts.

Context parallelism: each row is split over the CP ranks by megatron's zigzag rule
(parallel/context_parallel.py), which needs every span's length to divide by 2 x CP: a packed
trajectory's span is its tokens padded up to that multiple (a padded row is one span). Widths
also divide by TP under sequence parallelism, which splits the sequence again.

Each token keeps its trajectory's index in the global batch (segment id), which is what the
parallel loss sums by, so packing and splitting need no other bookkeeping. With routing
replay, each micro-batch also carries the routed experts of its input positions, packed and
split exactly like the tokens (learner/routing_replay.py); with the top-K gate, the engine's
top-K ids and log-probs of each target (zeros off policy tokens), likewise.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from megatron_fr.config.learner import longest_row, width_multiple
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.learner.routing_replay import padding_routing
from megatron_fr.parallel.context_parallel import zigzag_indices
from megatron_fr.parallel.loss import LossBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


class TokenRow(Protocol):
    """What a micro-batch reads of a trajectory: a Trajectory, or the same fields received
    as part of a shard (buffer/shards.py)."""

    @property
    def token_ids(self) -> np.ndarray: ...
    @property
    def action_mask(self) -> np.ndarray: ...
    @property
    def behavior_log_probs(self) -> np.ndarray: ...
    @property
    def routed_experts(self) -> RoutedExperts | None: ...
    @property
    def top_logprobs(self) -> TopLogProbs | None: ...
    @property
    def length(self) -> int: ...


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as this rank feeds it: model inputs, loss inputs, THD boundaries."""

    input_ids: Tensor
    """[rows, width / CP] tokens fed to the model (each trajectory's tokens but its last)."""
    positions: Tensor
    """[rows, width / CP] position of each token in its own trajectory (0 at its start)."""
    loss_batch: LossBatch
    cu_seqlens: Tensor | None = None
    """Packed rows: int32 span boundaries of the whole row before the CP split (THD
    cu_seqlens; a trajectory's span includes its CP padding, the row's tail is a span of its
    own). None for padded rows."""
    max_seqlen: int = 0
    """Packed rows: the longest span."""
    boundaries: tuple[int, ...] = ()
    """Packed rows: cu_seqlens as Python ints, kept on the host when the tensors move to the
    device, so attention reads the row's layout without a device-to-host sync per layer."""
    routing: Tensor | None = None
    """[rows, width / CP, layers, top_k] expert ids of every input position (routing replay),
    laid out like input_ids; None unless asked for."""

    @property
    def policy_tokens(self) -> int:
        return int(self.loss_batch.action_mask.sum())

    def packed_seq_params(self) -> PackedSeqParams | None:
        """megatron's PackedSeqParams for this row (None for padded rows).

        The padded boundaries serve as cu_seqlens too, as a span's padding follows its tokens
        and causal attention keeps it out of their outputs; TE then needs no pad_between_seqs.
        """
        if self.cu_seqlens is None:
            return None
        from megatron_fr.models.attention import HostPackedSeqParams

        cu = self.cu_seqlens
        boundaries = self.boundaries or tuple(int(b) for b in cu.tolist())  # once per micro-batch
        return HostPackedSeqParams(
            row_boundaries=boundaries,
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def to(self, device: torch.device | str) -> MicroBatch:
        def move(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.to(device)

        return dataclasses.replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            loss_batch=self.loss_batch.to(device),
            cu_seqlens=move(self.cu_seqlens),
            routing=move(self.routing),
        )


@dataclass(frozen=True)
class MicroBatchPlan:
    """Where every trajectory of one step goes; the same on every rank."""

    assignment: list[list[list[list[int]]]]
    """[DP rank][micro-batch][row] -> the trajectories of that row, in row order (an empty
    list is a padding row)."""
    rows: int
    width: int
    """Tokens per row before the CP split."""
    span_multiple: int
    """A packed trajectory's span is its model tokens rounded up to this (2 x CP, or 1)."""
    cp_size: int
    """Context-parallel ranks each row is split over."""
    packed: bool
    model_tokens: int
    """Tokens the model must see: each trajectory's length - 1, summed."""
    dp_tokens: tuple[int, ...] = ()
    """Trajectory tokens each DP rank trains (the load deal_to_ranks balances)."""

    @property
    def count(self) -> int:
        """Micro-batches per DP rank."""
        return len(self.assignment[0])

    @property
    def dp_imbalance(self) -> float:
        """max / mean of the DP ranks' token loads (1.0: perfectly balanced)."""
        return max(self.dp_tokens) / (sum(self.dp_tokens) / len(self.dp_tokens))

    @property
    def padding_fraction(self) -> float:
        """Share of the step's token slots (all DP ranks) that hold no trajectory token."""
        slots = len(self.assignment) * self.count * self.rows * self.width
        return 1.0 - self.model_tokens / slots


def deal_to_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Trajectory indices per DP rank: longest first, each to the least-loaded rank."""
    if len(lengths) < ranks:
        raise ValueError(f"a batch of {len(lengths)} trajectories cannot feed {ranks} DP ranks")
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += lengths[index]
    return [sorted(share) for share in shares]


def first_fit_decreasing(
    items: Sequence[int], sizes: Sequence[int], capacity: int
) -> list[list[int]]:
    """Bins (lists of items) of total size <= capacity: items longest first (ties: smaller
    item first), each into the first bin, in opening order, that has room."""
    bins: list[list[int]] = []
    room: list[int] = []
    for item in sorted(items, key=lambda i: (-sizes[i], i)):
        target = next((b for b, free in enumerate(room) if free >= sizes[item]), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(item)
        room[target] -= sizes[item]
    return bins


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    dp_size: int,
    micro_batch_tokens: int,
    pack: bool = True,
    cp_size: int = 1,
    sequence_parallel_size: int = 1,
) -> MicroBatchPlan:
    """The step's layout from the trajectory lengths (see the module doc).

    sequence_parallel_size: TP when sequence parallelism is on, else 1 (widths divide by it).
    """
    shares = deal_to_ranks(lengths, dp_size)
    _check_fits(max(lengths), micro_batch_tokens, cp_size, sequence_parallel_size)
    model_tokens = [length - 1 for length in lengths]
    span_multiple = 2 * cp_size if cp_size > 1 else 1
    multiple = width_multiple(cp_size, sequence_parallel_size)
    capacity = micro_batch_tokens * cp_size // multiple * multiple  # the widest row
    if pack:
        spans = [math.ceil(n / span_multiple) * span_multiple for n in model_tokens]
        bins = _pack_shares(shares, spans, capacity, multiple)
        fill = max(sum(spans[i] for i in row) for rank in bins for row in rank)
        width = math.ceil(fill / multiple) * multiple
        count = max(len(rank) for rank in bins)
        assignment = [[[row] for row in rank] + [[[]]] * (count - len(rank)) for rank in bins]
        rows = 1
    else:
        width = math.ceil(max(model_tokens) / multiple) * multiple
        rows = capacity // width
        count = max(math.ceil(len(share) / rows) for share in shares)
        assignment = [
            [
                [[i] for i in share[k * rows : (k + 1) * rows]]
                + [[]] * (rows - len(share[k * rows : (k + 1) * rows]))
                for k in range(count)
            ]
            for share in shares
        ]
    loads = tuple(sum(lengths[i] for i in share) for share in shares)
    return MicroBatchPlan(
        assignment, rows, width, span_multiple, cp_size, pack, sum(model_tokens), loads
    )


def _pack_shares(
    shares: list[list[int]], spans: list[int], capacity: int, multiple: int
) -> list[list[list[int]]]:
    """Each DP rank's share packed by first-fit decreasing into as few micro-batches as rows
    of `capacity` allow, then into rows as narrow as keeps that count: the smallest room (in
    steps of `multiple`, found by bisection; checked, so FFD's rare non-monotonicity can only
    leave a row wider, never a count higher) with which no rank needs more micro-batches."""

    def pack(room: int) -> list[list[list[int]]]:
        return [first_fit_decreasing(share, spans, room) for share in shares]

    count = max(len(rank) for rank in pack(capacity))
    low, high = math.ceil(max(spans) / multiple), capacity // multiple
    while low < high:
        middle = (low + high) // 2
        if max(len(rank) for rank in pack(middle * multiple)) <= count:
            high = middle
        else:
            low = middle + 1
    return pack(high * multiple)


def _check_fits(length: int, micro_batch_tokens: int, cp_size: int, sp_size: int) -> None:
    longest = longest_row(micro_batch_tokens, cp_size, sp_size)
    if length > longest:
        raise ValueError(
            f"a trajectory of {length} tokens does not fit a micro-batch: "
            f"learner.micro_batch_tokens {micro_batch_tokens} x parallel.context {cp_size} "
            f"holds trajectories of at most {longest} tokens (rows padded to a multiple of "
            f"{width_multiple(cp_size, sp_size)} under CP and SP)"
        )


def micro_batches_for_rank(
    batch: Mapping[int, TokenRow] | Sequence[TokenRow],
    plan: MicroBatchPlan,
    *,
    dp_rank: int,
    cp_rank: int = 0,
    pad_id: int = 0,
    routing: slice | None = None,
    top_logprobs: int = 0,
) -> list[MicroBatch]:
    """This DP rank's micro-batches of `plan`, each row split to this CP rank's tokens.
    `batch` holds (at least) the trajectories of this rank's share, by batch index, already
    validated (the buffer did). routing: the layers of the routed experts to carry (routing
    replay: this pipeline stage's; every trajectory has them: routing_replay.check_routed_batch);
    None: no routing. top_logprobs = K: carry their top-K log-probs, which every trajectory of
    the share must have, with this K (the top-K gate's)."""
    if top_logprobs:
        for index in itertools.chain.from_iterable(itertools.chain(*plan.assignment[dp_rank])):
            _check_top_k(batch[index], index, top_logprobs)
    return [
        _micro_batch(batch, plan, rows, cp_rank, pad_id, routing, top_logprobs)
        for rows in plan.assignment[dp_rank]
    ]


def _check_top_k(row: TokenRow, index: int, k: int) -> None:
    top = row.top_logprobs
    if top is None or top.k != k:
        got = "none" if top is None else f"K = {top.k}"
        raise ValueError(
            f"learner.flash_reinforce.gate_kl topk with gate_top_k {k} needs every trajectory's "
            f"top-{k} log-probs; trajectory {index} of the batch carries {got} (the rollout "
            "client asks the engines for them: RolloutClientConfig.top_logprobs)"
        )


def _micro_batch(
    batch: Mapping[int, TokenRow] | Sequence[TokenRow],
    plan: MicroBatchPlan,
    rows: list[list[int]],
    cp_rank: int,
    pad_id: int,
    routing: slice | None,
    top_logprobs: int,
) -> MicroBatch:
    built = [_row(batch, plan, indices, pad_id, routing, top_logprobs) for indices in rows]
    boundaries = built[0][1]  # padded rows all have [0, width]; a packed micro-batch is 1 row
    local = zigzag_indices(boundaries, plan.cp_size, cp_rank)
    fields = {key: torch.stack([row[key] for row, _ in built])[:, local] for key in built[0][0]}
    loss_batch = LossBatch(
        target_ids=fields["targets"],
        behavior_log_probs=fields["behavior"],
        action_mask=fields["mask"],
        segment_ids=fields["segments"],
        positions=fields["positions"],
        topk_ids=fields.get("topk_ids"),
        topk_log_probs=fields.get("topk_log_probs"),
    )
    micro = MicroBatch(
        fields["input_ids"], fields["positions"], loss_batch, routing=fields.get("routing")
    )
    if not plan.packed:
        return micro
    spans = [end - start for start, end in itertools.pairwise(boundaries)]
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    return dataclasses.replace(
        micro, cu_seqlens=cu_seqlens, max_seqlen=max(spans), boundaries=tuple(boundaries)
    )


def _row(
    batch: Mapping[int, TokenRow] | Sequence[TokenRow],
    plan: MicroBatchPlan,
    indices: list[int],
    pad_id: int,
    routing: slice | None,
    top_logprobs: int,
) -> tuple[dict[str, Tensor], list[int]]:
    """One row before the CP split, and its span boundaries. Position t of the model's input
    predicts token t + 1 of the same trajectory, so each trajectory brings its tokens but the
    last as inputs and its tokens but the first as targets (with their mask and mu)."""
    width = plan.width
    row = dict(
        input_ids=torch.full((width,), pad_id, dtype=torch.long),
        targets=torch.full((width,), pad_id, dtype=torch.long),
        mask=torch.zeros(width, dtype=torch.bool),
        behavior=torch.zeros(width, dtype=torch.float32),
        segments=torch.full((width,), -1, dtype=torch.long),
        positions=torch.zeros(width, dtype=torch.long),
    )
    if routing is not None:  # positions no trajectory fills: experts spread evenly (no loss)
        record = _any_routing(batch)
        _, layers, top_k = record.experts[:, routing].shape
        filler = padding_routing((1, width), top_k, record.num_experts)[0]
        row["routing"] = filler.repeat(1, layers, 1)
    if top_logprobs:
        row["topk_ids"] = torch.zeros((width, top_logprobs), dtype=torch.long)
        row["topk_log_probs"] = torch.zeros((width, top_logprobs), dtype=torch.float32)
    boundaries, start = [0], 0
    for index in indices:
        t = batch[index]
        n = t.length - 1
        span = slice(start, start + n)
        tokens = torch.from_numpy(t.token_ids)
        mask = torch.from_numpy(t.action_mask[1:])
        row["input_ids"][span], row["targets"][span] = tokens[:-1], tokens[1:]
        row["mask"][span] = mask
        row["behavior"][span] = torch.from_numpy(t.behavior_log_probs[1:]).masked_fill(~mask, 0.0)
        row["segments"][span] = index
        if routing is not None:  # the engine's experts of each input position (n: validated)
            assert t.routed_experts is not None  # routing_replay.check_routed_batch
            experts = torch.from_numpy(np.ascontiguousarray(t.routed_experts.experts[:, routing]))
            row["routing"][span] = experts.to(row["routing"].dtype)
        if top_logprobs:  # one record per policy token, in order: the targets under the mask
            assert t.top_logprobs is not None  # _check_top_k
            row["topk_ids"][span][mask] = torch.from_numpy(t.top_logprobs.ids).long()
            row["topk_log_probs"][span][mask] = torch.from_numpy(t.top_logprobs.log_probs)
        start += math.ceil(n / plan.span_multiple) * plan.span_multiple if plan.packed else n
        row["positions"][boundaries[-1] : start] = torch.arange(start - boundaries[-1])
        boundaries.append(start)
    if not plan.packed:
        boundaries = [0, width]  # one sequence: the trajectory and its right padding
        row["positions"] = torch.arange(width)
    elif start < width:
        row["positions"][start:] = torch.arange(width - start)
        boundaries.append(width)
    return row, boundaries


def _any_routing(batch: Mapping[int, TokenRow] | Sequence[TokenRow]) -> RoutedExperts:
    """Some trajectory's routed experts (they all have the same layout: validated)."""
    first = next(iter(batch.values())) if isinstance(batch, Mapping) else batch[0]
    if first.routed_experts is None:
        raise ValueError("routing replay needs every trajectory's routed experts")
    return first.routed_experts
