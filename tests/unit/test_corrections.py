"""Rollout corrections against per-token / per-row Python loops on exp of the log-ratio."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, log_sigmoid, random_policy_mask

from megatron_fr.algo.corrections import (
    sequence_mask,
    token_mask_outside,
    truncated_importance_weights,
)


def random_batch(seed, dtype=torch.float64):
    """Per-row drift, so that some rows sit close to the behaviour policy and some do not."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 8, (1,), generator=gen))
    length = int(torch.randint(1, 10, (1,), generator=gen))
    mask = random_policy_mask(gen, batch, length)
    behavior_logit = torch.randn(batch, length, generator=gen, dtype=dtype) * 2
    drift = torch.rand(batch, 1, generator=gen, dtype=dtype) * 1.5
    logit = behavior_logit + drift * torch.randn(batch, length, generator=gen, dtype=dtype)
    log_probs = log_sigmoid(logit)
    behavior = log_sigmoid(behavior_logit)
    return log_probs, behavior, mask


def ratio(log_probs, behavior, i, t):
    return math.exp(log_probs[i, t].item() - behavior[i, t].item())


def reference_tis(log_probs, behavior, mask, cap):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, t in mask.nonzero().tolist():
        out[i, t] = min(ratio(log_probs, behavior, i, t), cap)
    return out


def reference_token_mask(log_probs, behavior, mask, low, high):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i, t in mask.nonzero().tolist():
        out[i, t] = float(low <= ratio(log_probs, behavior, i, t) <= high)
    return out


def reference_sequence_mask(log_probs, behavior, mask, low, high, mode):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        policy = [t for t in range(mask.shape[1]) if mask[i, t]]
        total = math.fsum(log_probs[i, t].item() - behavior[i, t].item() for t in policy)
        statistic = math.exp(total if mode == "sum" else total / len(policy))
        for t in policy:
            out[i, t] = float(low <= statistic <= high)
    return out


def test_truncated_importance_weights_match_reference():
    truncated = 0
    for seed in range(20):
        log_probs, behavior, mask = random_batch(seed)
        for cap in (0.5, 1.0, 2.0, 5.0):
            weights = truncated_importance_weights(log_probs, behavior, mask, cap=cap)
            expected = reference_tis(log_probs, behavior, mask, cap)
            assert_close(weights, expected, atol=1e-13)
            truncated += int((weights == cap).sum())
    assert truncated > 0


def test_token_mask_matches_reference():
    kept = dropped = 0
    for seed in range(20):
        log_probs, behavior, mask = random_batch(seed)
        for low, high in [(0.5, 2.0), (0.8, 1.25), (0.0, 1.0), (1.0, math.inf)]:
            keep = token_mask_outside(log_probs, behavior, mask, low=low, high=high)
            expected = reference_token_mask(log_probs, behavior, mask, low, high)
            assert torch.equal(keep, expected)
            kept += int(keep.sum())
            dropped += int(mask.sum() - keep.sum())
    assert kept > 0 and dropped > 0


@pytest.mark.parametrize(
    ("mode", "bounds"),
    [("sum", [(0.5, 2.0), (0.1, 10.0), (0.0, 1.0)]), ("mean", [(0.8, 1.25), (0.9, 1.1)])],
)
def test_sequence_mask_matches_reference(mode, bounds):
    kept_rows = dropped_rows = 0
    for seed in range(20):
        log_probs, behavior, mask = random_batch(seed)
        for low, high in bounds:
            keep = sequence_mask(log_probs, behavior, mask, low=low, high=high, mode=mode)
            expected = reference_sequence_mask(log_probs, behavior, mask, low, high, mode)
            assert torch.equal(keep, expected)
            row_kept = keep.sum(dim=1) > 0
            kept_rows += int(row_kept.sum())
            dropped_rows += int((~row_kept).sum())
    assert kept_rows > 0 and dropped_rows > 0


def test_by_hand_with_inclusive_bounds():
    """Ratios 2, 1, 0.5 (exact in binary); bounds are inclusive, so ratio 1 in [1, 1] is kept."""
    behavior = torch.log(torch.tensor([[0.25, 0.5, 0.5, 0.5]], dtype=torch.float64))
    log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.25, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[True, True, True, False]])
    tis = truncated_importance_weights(log_probs, behavior, mask, cap=1.5)
    assert tis.tolist() == [[1.5, 1.0, 0.5, 0.0]]
    keep = token_mask_outside(log_probs, behavior, mask, low=1.0, high=1.0)
    assert keep.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    keep = token_mask_outside(log_probs, behavior, mask, low=0.5, high=1.0)
    assert keep.tolist() == [[0.0, 1.0, 1.0, 0.0]]
    # Sum of log-ratios is log(2 * 1 * 0.5) = 0: exp(sum) = 1; the mean is 0 too.
    for mode in ("sum", "mean"):
        keep = sequence_mask(log_probs, behavior, mask, low=1.0, high=1.0, mode=mode)
        assert keep.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_sequence_statistic_that_overflows_exp_still_decides():
    """1000 tokens at log-ratio 1: exp(sum) = e^1000 overflows even float64, e^mean = e."""
    behavior = torch.full((2, 1000), -2.0)
    log_probs = torch.full((2, 1000), -1.0)
    mask = torch.ones(2, 1000, dtype=torch.bool)
    mask[1, 1:] = False  # row 1: one token, exp(sum) = e
    keep = sequence_mask(log_probs, behavior, mask, low=0.5, high=1e30, mode="sum")
    assert keep.sum(dim=1).tolist() == [0.0, 1.0]
    keep = sequence_mask(log_probs, behavior, mask, low=0.5, high=math.inf, mode="sum")
    assert keep.sum(dim=1).tolist() == [1000.0, 1.0]
    keep = sequence_mask(log_probs, behavior, mask, low=2.7, high=2.8, mode="mean")
    assert keep.sum(dim=1).tolist() == [1000.0, 1.0]
    tis = truncated_importance_weights(log_probs - 99, log_probs - 200, mask, cap=3.0)
    assert tis.max().item() == 3.0 and torch.isfinite(tis).all()


def test_outputs_are_detached_zero_off_policy_and_keep_the_dtype():
    log_probs, behavior, mask = random_batch(4)
    log_probs = log_probs.float().requires_grad_(True)
    behavior = behavior.float().requires_grad_(True)
    padded = torch.where(mask, log_probs, math.nan)
    outputs = [
        truncated_importance_weights(padded, behavior, mask, cap=2.0),
        token_mask_outside(padded, behavior, mask, low=0.0, high=math.inf),
        sequence_mask(padded, behavior, mask, low=0.0, high=math.inf, mode="mean"),
    ]
    for output in outputs:
        assert output.dtype == torch.float32 and not output.requires_grad
        assert torch.count_nonzero(output[~mask]) == 0
    # low = 0, high = inf keeps every policy token.
    assert torch.equal(outputs[1], mask.float()) and torch.equal(outputs[2], mask.float())


def _good():
    return random_batch(1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda lp, mu, m: truncated_importance_weights(lp, mu, m, cap=0.0), "cap must be"),
        (lambda lp, mu, m: truncated_importance_weights(lp, mu, m, cap=math.inf), "cap must"),
        (lambda lp, mu, m: truncated_importance_weights(lp, mu, m, cap=math.nan), "finite"),
        (lambda lp, mu, m: token_mask_outside(lp, mu, m, low=2.0, high=0.5), "low <= high"),
        (lambda lp, mu, m: token_mask_outside(lp, mu, m, low=-0.1, high=2.0), "0 <= low"),
        (lambda lp, mu, m: token_mask_outside(lp, mu, m, low=0.0, high=0.0), "high > 0"),
        (lambda lp, mu, m: token_mask_outside(lp, mu, m, low=math.nan, high=2.0), "low=nan"),
        (
            lambda lp, mu, m: sequence_mask(lp, mu, m, low=0.5, high=2.0, mode="max"),
            r"unknown sequence_mask mode 'max'",
        ),
        (
            lambda lp, mu, m: sequence_mask(lp, mu, m, low=3.0, high=2.0, mode="sum"),
            r"interval \[low, high\]",
        ),
        (
            lambda lp, mu, m: token_mask_outside(lp[None], mu, m, low=0.5, high=2.0),
            "log_probs has shape",
        ),
        (
            lambda lp, mu, m: sequence_mask(lp, mu.float(), m, low=0.5, high=2.0, mode="sum"),
            "dtype mismatch",
        ),
        (
            lambda lp, mu, m: truncated_importance_weights(lp, mu + 3, m, cap=2.0),
            "behavior_log_probs has positive values",
        ),
        (
            lambda lp, mu, m: truncated_importance_weights(lp * math.inf, mu, m, cap=2.0),
            "log_probs has non-finite",
        ),
        (
            lambda lp, mu, m: token_mask_outside(lp, mu, m.long(), low=0.5, high=2.0),
            "action_mask must be torch.bool",
        ),
        (
            lambda lp, mu, m: sequence_mask(lp, mu, m & False, low=0.5, high=2.0, mode="mean"),
            "has no policy tokens",
        ),
    ],
)
def test_bad_inputs_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call(*_good())
