"""Rollout corrections against per-token / per-trajectory Python loops on exp of the log-ratio,
for one trajectory per row and for trajectories packed two to a row, split in half with the
per-trajectory sums added up by the reduce hook (what the context-parallel path does)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import log_sigmoid, random_policy_mask

from megatron_fr.algo.corrections import correction_keep_mask


def random_batch(seed, dtype=torch.float64):
    """Per-row drift, so that some rows sit close to the behaviour policy and some do not."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 8, (1,), generator=gen))
    length = int(torch.randint(1, 10, (1,), generator=gen))
    mask = random_policy_mask(gen, batch, length)
    behavior_logit = torch.randn(batch, length, generator=gen, dtype=dtype) * 2
    drift = torch.rand(batch, 1, generator=gen, dtype=dtype) * 1.5
    logit = behavior_logit + drift * torch.randn(batch, length, generator=gen, dtype=dtype)
    return log_sigmoid(logit), log_sigmoid(behavior_logit), mask


def rows(mask):
    return torch.arange(mask.shape[0])[:, None].expand(mask.shape)


def keep(log_probs, behavior, mask, correction, low, high):
    log_ratio = torch.where(mask, log_probs - behavior, 0)
    segments = torch.where(mask, rows(mask), -1)
    return correction_keep_mask(
        log_ratio, mask, segments, mask.shape[0], correction=correction, low=low, high=high
    )


def reference(log_probs, behavior, mask, correction, low, high):
    out = torch.zeros(mask.shape, dtype=torch.bool)
    for i in range(mask.shape[0]):
        policy = [t for t in range(mask.shape[1]) if mask[i, t]]
        ratios = [log_probs[i, t].item() - behavior[i, t].item() for t in policy]
        if correction == "token_mask":
            kept = [low <= math.exp(r) <= high for r in ratios]
        else:
            total = math.fsum(ratios)
            statistic = total if correction.endswith("sum") else total / len(policy)
            kept = [low <= math.exp(statistic) <= high] * len(policy)
        for t, k in zip(policy, kept, strict=True):
            out[i, t] = k
    return out


CASES = [
    ("token_mask", [(0.5, 2.0), (0.8, 1.25), (0.0, 1.0), (1.0, math.inf)]),
    ("sequence_mask_sum", [(0.5, 2.0), (0.1, 10.0), (0.0, 1.0)]),
    ("sequence_mask_mean", [(0.8, 1.25), (0.9, 1.1)]),
]


@pytest.mark.parametrize(("correction", "bounds"), CASES)
def test_corrections_match_reference(correction, bounds):
    kept = dropped = 0
    for seed in range(20):
        log_probs, behavior, mask = random_batch(seed)
        for low, high in bounds:
            mine = keep(log_probs, behavior, mask, correction, low, high)
            assert torch.equal(mine, reference(log_probs, behavior, mask, correction, low, high))
            kept += int(mine.sum())
            dropped += int(mask.sum() - mine.sum())
    assert kept > 0 and dropped > 0


@pytest.mark.parametrize(("correction", "bounds"), CASES)
def test_packed_and_split_trajectories_get_the_same_decisions(correction, bounds):
    """Rows 2k and 2k+1 packed into one row, cut into two halves (two "ranks"); each half
    decides with the per-trajectory sums of both halves, as reduce_segments gives them."""
    log_probs, behavior, mask = random_batch(7)
    log_probs, behavior, mask = (torch.cat([x, x.flip(0)]) for x in (log_probs, behavior, mask))
    batch, length = mask.shape
    segments = torch.where(mask, rows(mask), -1)
    packed = [x.reshape(batch // 2, 2 * length) for x in (log_probs, behavior, mask, segments)]
    half = length
    pieces = [[x[:, :half] for x in packed], [x[:, half:] for x in packed]]

    def decide(piece, bounds, reduce):
        lp, mu, m, seg = piece
        return correction_keep_mask(
            torch.where(m, lp - mu, 0),
            m,
            seg,
            batch,
            correction=correction,
            low=bounds[0],
            high=bounds[1],
            reduce_segments=reduce,
        )

    for low, high in bounds:
        partials: list[torch.Tensor] = []
        for piece in pieces:  # first pass: each half's own partial sums
            decide(piece, (low, high), lambda t, kept=partials: kept.append(t) or t)
        total = sum(partials) if partials else None
        decided = [decide(piece, (low, high), lambda _t, total=total: total) for piece in pieces]
        together = torch.cat(decided, dim=1).reshape(batch, length)
        assert torch.equal(together, keep(log_probs, behavior, mask, correction, low, high))


def test_by_hand_with_inclusive_bounds():
    """Ratios 2, 1, 0.5 (exact in binary); bounds are inclusive, so ratio 1 in [1, 1] is kept."""
    behavior = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.5]], dtype=torch.float64))
    log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.25, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[True, True, True, False]])
    assert keep(log_probs, behavior, mask, "token_mask", 1.0, 1.0).tolist() == [
        [False, True, False, False]
    ]
    assert keep(log_probs, behavior, mask, "token_mask", 0.5, 1.0).tolist() == [
        [False, True, True, False]
    ]
    # Sum of log-ratios is log(2 * 1 * 0.5) = 0: exp(sum) = 1; the mean is 0 too.
    for correction in ("sequence_mask_sum", "sequence_mask_mean"):
        assert keep(log_probs, behavior, mask, correction, 1.0, 1.0).tolist() == [
            [True, True, True, False]
        ]


def test_sequence_statistic_that_overflows_exp_still_decides():
    """1000 tokens at log-ratio 1: exp(sum) = e^1000 overflows even float64, e^mean = e."""
    behavior = torch.full((2, 1000), -2.0)
    log_probs = torch.full((2, 1000), -1.0)
    mask = torch.ones(2, 1000, dtype=torch.bool)
    mask[1, 1:] = False  # row 1: one token, exp(sum) = e
    kept = keep(log_probs, behavior, mask, "sequence_mask_sum", 0.5, 1e30)
    assert kept.sum(dim=1).tolist() == [0, 1]
    kept = keep(log_probs, behavior, mask, "sequence_mask_sum", 0.5, math.inf)
    assert kept.sum(dim=1).tolist() == [1000, 1]
    kept = keep(log_probs, behavior, mask, "sequence_mask_mean", 2.7, 2.8)
    assert kept.sum(dim=1).tolist() == [1000, 1]


def test_none_keeps_every_policy_token_and_nothing_else():
    log_probs, behavior, mask = random_batch(4)
    assert torch.equal(keep(log_probs, behavior, mask, "none", 0.5, 2.0), mask)
    for correction, _ in CASES:  # low = 0, high = inf keeps every policy token
        assert torch.equal(keep(log_probs, behavior, mask, correction, 0.0, math.inf), mask)


@pytest.mark.parametrize(
    ("correction", "low", "high", "message"),
    [
        ("token_mask", 2.0, 0.5, "low <= high"),
        ("token_mask", -0.1, 2.0, "0 <= low"),
        ("token_mask", 0.0, 0.0, "high > 0"),
        ("token_mask", math.nan, 2.0, "low=nan"),
        ("sequence_mask_sum", 3.0, 2.0, r"interval \[low, high\]"),
        ("sequence_mask_max", 0.5, 2.0, r"unknown correction 'sequence_mask_max'"),
    ],
)
def test_bad_settings_are_refused(correction, low, high, message):
    log_probs, behavior, mask = random_batch(1)
    with pytest.raises(ValueError, match=message):
        keep(log_probs, behavior, mask, correction, low, high)
