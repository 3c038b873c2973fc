"""The learner's micro-batch layout: the packing rule, its guarantees, the THD boundaries it
hands megatron and the context-parallel split, checked against written-out expectations and
megatron's own THD RoPE and CP slicing code (run on CPU, no process group needed)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.learner.micro_batches import (
    first_fit_decreasing,
    micro_batches_for_rank,
    plan_micro_batches,
)
from megatron_fr.parallel.context_parallel import zigzag_indices


def long_tailed_batch(size: int, seed: int, max_length: int = 120) -> list[Trajectory]:
    """Lognormal lengths (median ~20 tokens, a few near max_length), prompt then policy."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(3.0 + torch.randn(size, generator=gen)).clamp(3, max_length).long()
    batch = []
    for index, length in enumerate(lengths.tolist()):
        prompt = int(torch.randint(1, length - 1, (1,), generator=gen))
        tokens = torch.randint(0, 1000, (length,), generator=gen).tolist()
        mask = [False] * prompt + [True] * (length - prompt)
        behavior = [0.0] * prompt + (-torch.rand(length - prompt, generator=gen) - 0.01).tolist()
        versions = [-1] * prompt + [0] * (length - prompt)
        batch.append(Trajectory(f"p{index}", tokens, mask, behavior, versions, 1.0))
    return batch


def test_first_fit_decreasing_places_longest_first_in_the_first_bin_with_room():
    # sorted: 5 (0), 4 (1), 3 (2), 3 (3), 2 (4), 2 (5), 1 (6); capacity 8:
    # 5 opens bin 0; 4 does not fit (room 3) and opens bin 1; 3 fills bin 0; 3 joins bin 1
    # (room 1 left); 2 opens bin 2, the other 2 joins it; 1 goes to bin 1, the first with room.
    sizes = [5, 4, 3, 3, 2, 2, 1]
    assert first_fit_decreasing(range(7), sizes, 8) == [[0, 2], [1, 3, 6], [4, 5]]


LAYOUTS = [  # (pack, DP, CP, SP size, micro_batch_tokens: per CP rank)
    (True, 1, 1, 1, 256),
    (True, 4, 1, 1, 256),
    (True, 2, 2, 1, 256),
    (True, 2, 2, 2, 250),
    (True, 1, 4, 1, 512),
    (False, 2, 1, 1, 256),
    (False, 2, 2, 2, 512),
]


@pytest.mark.parametrize(("pack", "dp", "cp", "sp", "budget"), LAYOUTS)
def test_every_token_lands_once_in_equal_shapes_within_the_budget(pack, dp, cp, sp, budget):
    batch = long_tailed_batch(48, seed=dp * 10 + cp)
    plan = plan_micro_batches(
        [t.length for t in batch],
        dp_size=dp,
        micro_batch_tokens=budget,
        pack=pack,
        cp_size=cp,
        sequence_parallel_size=sp,
    )
    assert plan == plan_micro_batches(
        [t.length for t in batch],
        dp_size=dp,
        micro_batch_tokens=budget,
        pack=pack,
        cp_size=cp,
        sequence_parallel_size=sp,
    ), "the plan depends on the lengths alone"
    assert plan.rows * plan.width <= budget * cp
    assert plan.width % ((2 * cp if cp > 1 else 1) * sp) == 0
    seen: dict[tuple[int, int], int] = {}
    shapes, real, slots = set(), 0, 0
    for dp_rank, cp_rank in itertools.product(range(dp), range(cp)):
        micros = micro_batches_for_rank(batch, plan, dp_rank=dp_rank, cp_rank=cp_rank)
        assert len(micros) == plan.count
        for micro in micros:
            loss = micro.loss_batch
            shapes.add(micro.input_ids.shape)
            slots += micro.input_ids.numel()
            real += int((loss.segment_ids >= 0).sum())
            for where in (loss.segment_ids >= 0).nonzero().tolist():
                segment, position = (int(x[*where]) for x in (loss.segment_ids, loss.positions))
                seen[segment, position] = seen.get((segment, position), 0) + 1
                t = batch[segment]
                assert micro.input_ids[*where] == t.token_ids[position]
                assert loss.target_ids[*where] == t.token_ids[position + 1]
                assert loss.action_mask[*where] == t.action_mask[position + 1]
                expected = t.behavior_log_probs[position + 1] if t.action_mask[position + 1] else 0
                assert loss.behavior_log_probs[*where] == pytest.approx(expected)
            assert not loss.action_mask[loss.segment_ids < 0].any()
    assert shapes == {(plan.rows, plan.width // cp)}, "every rank runs the same shape"
    expected = {(i, p) for i, t in enumerate(batch) for p in range(t.length - 1)}
    assert set(seen) == expected and set(seen.values()) == {1}, "a token lost or duplicated"
    assert plan.padding_fraction == pytest.approx(1 - real / slots, abs=1e-12)
    loads = [
        sum(batch[i].length for micro in rank for row in micro for i in row)
        for rank in plan.assignment
    ]
    assert max(loads) - min(loads) <= max(t.length for t in batch), "DP ranks are balanced"


@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (4, 1), (3, 2)])
def test_packed_rows_are_as_narrow_as_the_micro_batch_count_allows(dp, cp):
    """The count is what the full budget (512 tokens a CP rank) needs; one step narrower,
    some rank needs more (or the longest trajectory no longer fits)."""
    lengths = [t.length for t in long_tailed_batch(64, seed=dp + cp)]
    plan = plan_micro_batches(lengths, dp_size=dp, micro_batch_tokens=512 // cp, cp_size=cp)
    step = 2 * cp if cp > 1 else 1
    spans = [math.ceil((n - 1) / step) * step for n in lengths]
    shares = [[i for micro in rank for row in micro for i in row] for rank in plan.assignment]
    assert sorted(itertools.chain(*shares)) == list(range(len(lengths)))

    def micro_batches_needed(room: int) -> int:
        return max(len(first_fit_decreasing(share, spans, room)) for share in shares)

    assert plan.count == micro_batches_needed(512 // step * step)
    if plan.width - step >= max(spans):
        assert micro_batches_needed(plan.width - step) > plan.count
    else:
        assert plan.width == max(spans)


def test_packing_cuts_the_padding_of_a_long_tailed_batch():
    lengths = [t.length for t in long_tailed_batch(128, seed=7)]
    padded = plan_micro_batches(lengths, dp_size=4, micro_batch_tokens=512, pack=False)
    packed = plan_micro_batches(lengths, dp_size=4, micro_batch_tokens=512, pack=True)
    assert packed.padding_fraction < padded.padding_fraction / 3
    assert packed.count * packed.width < padded.count * padded.rows * padded.width


def test_packed_row_boundaries_are_the_thd_cu_seqlens():
    # DP2, CP2 (spans padded to multiples of 4): rank 0 gets the 12-token trajectory (11 model
    # tokens -> span 12), rank 1 the 3-token one (2 -> span 4) and an 8-token tail span.
    policy = [False] + [True] * 11
    batch = [
        Trajectory("a", list(range(12)), policy, [0.0] + [-0.5] * 11, [-1] + [0] * 11, 1.0),
        Trajectory("b", [5, 6, 7], [False, True, True], [0.0, -0.1, -0.2], [-1, 0, 0], 0.0),
    ]
    plan = plan_micro_batches([12, 3], dp_size=2, micro_batch_tokens=64, cp_size=2)
    assert plan.width == 12 and plan.count == 1
    long_row = micro_batches_for_rank(batch, plan, dp_rank=0)[0]
    short_row = micro_batches_for_rank(batch, plan, dp_rank=1)[0]
    assert long_row.cu_seqlens.tolist() == [0, 12] and long_row.max_seqlen == 12
    assert short_row.cu_seqlens.tolist() == [0, 4, 12] and short_row.max_seqlen == 8
    assert short_row.cu_seqlens.dtype == torch.int32
    params = short_row.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 8
    for cu in (params.cu_seqlens_q, params.cu_seqlens_kv, params.cu_seqlens_q_padded):
        assert cu.tolist() == [0, 4, 12]
    # CP rank 0 holds chunks 0 and 3 of each span: tokens 0, 3 of trajectory b, 0-1, 6-7 of
    # the tail; positions restart in each span
    assert short_row.positions.tolist() == [[0, 3, 0, 1, 6, 7]]
    assert short_row.loss_batch.segment_ids.tolist() == [[1, -1, -1, -1, -1, -1]]
    padded = plan_micro_batches([12, 3], dp_size=2, micro_batch_tokens=64, pack=False)
    assert micro_batches_for_rank(batch, padded, dp_rank=0)[0].packed_seq_params() is None


def test_zigzag_split_is_megatrons_per_sequence_cp_slicing():
    """Against megatron's own THD RoPE slicing (rope_utils._get_thd_freqs_on_this_cp_rank):
    reading a table of row positions with it gives the positions each CP rank holds."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    gen = torch.Generator().manual_seed(0)
    for cp in (1, 2, 3, 4):
        spans = (torch.randint(1, 5, (5,), generator=gen) * 2 * cp).tolist()
        boundaries = [0, *itertools.accumulate(spans)]
        table = torch.arange(boundaries[-1])
        held = []
        for rank in range(cp):
            theirs = torch.cat(
                [
                    _get_thd_freqs_on_this_cp_rank(rank, cp, torch.empty(span // cp), table, start)
                    for start, span in zip(boundaries, spans, strict=False)
                ]
            )
            mine = zigzag_indices(boundaries, cp, rank)
            assert mine.tolist() == theirs.tolist(), (cp, rank)
            held.append(mine)
        assert sorted(torch.cat(held).tolist()) == list(range(boundaries[-1]))


class CPGroup:
    """What megatron's RoPE asks of a CP process group: its size and this rank."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_megatron_thd_rope_restarts_at_each_packed_trajectory(monkeypatch):
    """megatron's THD RoPE, given a packed row's PackedSeqParams and this CP rank's tokens,
    rotates every token as if its trajectory were alone in a row (positions from 0)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # where RoPE puts its table
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False)
    batch = long_tailed_batch(9, seed=3, max_length=40)
    values = [torch.randn(t.length - 1, 2, 8) for t in batch]  # [tokens, heads, dim]
    single = CPGroup(1)
    rope = RotaryEmbedding(8, 1.0, use_cpu_initialization=True, cp_group=single)
    alone = [  # each trajectory alone in a row: positions 0, 1, ...
        apply_rotary_pos_emb(v[:, None], rope(len(v)), config, cp_group=single)[:, 0]
        for v in values
    ]
    for cp in (1, 2):
        plan = plan_micro_batches(
            [t.length for t in batch], dp_size=1, micro_batch_tokens=96 // cp, cp_size=cp
        )
        assert plan.count > 1
        for rank in range(cp):
            group = CPGroup(cp, rank)
            for micro in micro_batches_for_rank(batch, plan, dp_rank=0, cp_rank=rank):
                params = micro.packed_seq_params()
                segments = micro.loss_batch.segment_ids[0].tolist()
                positions = micro.positions[0].tolist()
                local = torch.randn(len(segments), 2, 8)
                real = [j for j, s in enumerate(segments) if s >= 0]
                for j in real:
                    local[j] = values[segments[j]][positions[j]]
                freqs = rope(params.max_seqlen_q, packed_seq=True, cp_group=group)
                rotated = apply_rotary_pos_emb(
                    local, freqs, config, cu_seqlens=params.cu_seqlens_q_padded, cp_group=group
                )
                for j in real:
                    expected = alone[segments[j]][positions[j]]
                    assert torch.allclose(rotated[j], expected, atol=1e-6), (cp, rank, j)


def test_bad_layouts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"learner\.micro_batch_tokens 32 x parallel\.context 1"):
        plan_micro_batches([10, 40], dp_size=1, micro_batch_tokens=32)
    # 33 model tokens -> span 36 > 17 x 2 = 34, rounded down to a multiple of 2 x CP: 32
    with pytest.raises(ValueError, match="at most 33 tokens"):
        plan_micro_batches([34], dp_size=1, micro_batch_tokens=17, cp_size=2)
    assert plan_micro_batches([33], dp_size=1, micro_batch_tokens=17, cp_size=2).width == 32
    with pytest.raises(ValueError, match="cannot feed 2 DP ranks"):
        plan_micro_batches([10], dp_size=2, micro_batch_tokens=32)
    with pytest.raises(ValueError, match="2 x CP = 4 equal chunks"):
        zigzag_indices([0, 6], 2, 0)
    with pytest.raises(ValueError, match="rise strictly"):
        zigzag_indices([0, 4, 4], 2, 0)


def test_padding_fraction_counts_every_slot_of_every_rank():
    # DP2, padded: widths 9 (longest 10-token trajectory), 2 rows per micro-batch of 18 tokens;
    # rank 0: [10] -> 1 micro-batch; rank 1: [3, 4] -> 1 micro-batch: 2 x 2 x 9 = 36 slots for
    # 9 + 2 + 3 = 14 model tokens.
    plan = plan_micro_batches([10, 3, 4], dp_size=2, micro_batch_tokens=18, pack=False)
    assert (plan.rows, plan.width, plan.count) == (2, 9, 1)
    assert plan.padding_fraction == pytest.approx(1 - 14 / 36)
    packed = plan_micro_batches([10, 3, 4], dp_size=2, micro_batch_tokens=18)
    assert (packed.rows, packed.width, packed.count) == (1, 9, 1)
    assert packed.padding_fraction == pytest.approx(1 - 14 / 18)
    assert math.isclose(packed.model_tokens, 14)


def with_top_k(t: Trajectory, k: int = 3) -> Trajectory:
    """t with a top-k record whose row for the policy token at position p holds ids
    token + 1000 j and log-probs -(j + 1) - p / 1000: each row names its token and place."""
    rows = [
        (token, p) for p, (token, m) in enumerate(zip(t.token_ids, t.action_mask, strict=True)) if m
    ]
    ids = [[token + 1000 * j for j in range(k)] for token, _ in rows]
    log_probs = [[-(j + 1) - p / 1000 for j in range(k)] for _, p in rows]
    return dataclasses.replace(t, top_logprobs=TopLogProbs.of(ids, log_probs, k))


@pytest.mark.parametrize(("pack", "dp", "cp", "sp", "budget"), [LAYOUTS[3], LAYOUTS[6]])
def test_top_k_records_ride_with_their_policy_targets(pack, dp, cp, sp, budget):
    """The top-K gate's inputs, packed and split like the tokens: at every position whose
    target is a policy token, that token's row; zeros everywhere else."""
    batch = [with_top_k(t) for t in long_tailed_batch(24, seed=5)]
    plan = plan_micro_batches(
        [t.length for t in batch],
        dp_size=dp,
        micro_batch_tokens=budget,
        pack=pack,
        cp_size=cp,
        sequence_parallel_size=sp,
    )
    checked = 0
    for dp_rank, cp_rank in itertools.product(range(dp), range(cp)):
        for micro in micro_batches_for_rank(
            batch, plan, dp_rank=dp_rank, cp_rank=cp_rank, top_logprobs=3
        ):
            loss = micro.loss_batch
            assert loss.topk_ids.shape == (*loss.target_ids.shape, 3)
            assert not loss.topk_ids[~loss.action_mask].any()
            assert not loss.topk_log_probs[~loss.action_mask].any()
            for where in loss.action_mask.nonzero().tolist():
                target, position = int(loss.target_ids[*where]), int(loss.positions[*where]) + 1
                assert loss.topk_ids[*where].tolist() == [target, target + 1000, target + 2000]
                expected = [-(j + 1) - position / 1000 for j in range(3)]
                assert loss.topk_log_probs[*where].tolist() == pytest.approx(expected)
                checked += 1
    assert checked == sum(t.num_policy_tokens for t in batch)


def test_a_trajectory_without_the_top_k_asked_for_is_refused_by_its_place():
    batch = long_tailed_batch(4, seed=1)
    batch[2] = with_top_k(batch[2], k=2)
    plan = plan_micro_batches([t.length for t in batch], dp_size=1, micro_batch_tokens=512)
    with pytest.raises(ValueError, match="trajectory 0 of the batch carries none"):
        micro_batches_for_rank(batch, plan, dp_rank=0, top_logprobs=2)
    batch = [with_top_k(t, k=2) for t in batch]
    with pytest.raises(
        ValueError,
        match="gate_top_k 3 needs every trajectory's top-3 log-probs; "
        "trajectory 0 of the batch carries K = 2",
    ):
        micro_batches_for_rank(batch, plan, dp_rank=0, top_logprobs=3)
