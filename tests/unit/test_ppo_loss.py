"""The PPO-clip loss (algo/ppo.py) against a token-by-token Python loop and a written-out
gradient formula, for every aggregation and correction; and its diagnostic KL."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, log_sigmoid, random_policy_mask

from megatron_fr.algo.flash_reinforce import RatioOverflowError
from megatron_fr.algo.ppo import ppo_clip_loss
from megatron_fr.config.algo import PPOClipConfig

AGGREGATIONS = ["token_mean", "sequence_mean", "token_sum_norm"]


def random_batch(seed, dtype=torch.float64, batch=None, length=None):
    """Ratios spread over roughly [0.3, 3], so that both clip edges are hit."""
    gen = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(1, 7, (1,), generator=gen))
    length = length or int(torch.randint(1, 11, (1,), generator=gen))
    mask = random_policy_mask(gen, batch, length)
    old_logit = torch.randn(batch, length, generator=gen, dtype=dtype) * 2
    log_probs = log_sigmoid(old_logit + torch.randn(batch, length, generator=gen, dtype=dtype))
    behavior = log_sigmoid(old_logit)
    advantages = torch.randn(batch, generator=gen, dtype=dtype)
    return log_probs, behavior, advantages, mask


def loss_of(log_probs, behavior, advantages, mask, **config):
    """ppo_clip_loss with one trajectory per row (segment = row)."""
    segments = torch.where(mask, torch.arange(mask.shape[0])[:, None], -1)
    settings = PPOClipConfig(**{"aggregation": "token_mean", **config})
    return ppo_clip_loss(log_probs, behavior, advantages, mask, segments, mask.sum(1), settings)


def reference(log_probs, behavior, advantages, mask, eps_low, eps_high, aggregation, kept):
    """(loss, d loss / d log_probs, clipped count), token by token in Python floats.

    The gradient of -min(r A, clip(r) A) is -A r where r A is the minimum (the unclipped
    branch), 0 where the clipped branch is: for A > 0 above 1 + eps_high, for A < 0 below
    1 - eps_low. Times the aggregation's weight; 0 on tokens the correction dropped."""
    batch, length = mask.shape
    counts = [int(mask[i].sum()) for i in range(batch)]
    loss, grad, clipped_count = 0.0, torch.zeros(batch, length, dtype=torch.float64), 0
    for i in range(batch):
        scale = {
            "token_mean": 1 / sum(counts),
            "sequence_mean": 1 / (batch * counts[i]),
            "token_sum_norm": 1 / (batch * max(counts)),
        }[aggregation]
        for t in range(length):
            if not mask[i, t]:
                continue
            r = math.exp(log_probs[i, t].item() - behavior[i, t].item())
            a = advantages[i].item()
            clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            clipped_count += clipped
            if kept[i][t]:
                loss += -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a) * scale
                grad[i, t] = 0.0 if clipped else -a * r * scale
    return loss, grad, clipped_count


def kept_tokens(log_probs, behavior, mask, correction, low, high):
    """Which policy tokens a correction keeps, written out per token / per row."""
    kept = []
    for i in range(mask.shape[0]):
        policy = [t for t in range(mask.shape[1]) if mask[i, t]]
        ratios = {t: log_probs[i, t].item() - behavior[i, t].item() for t in policy}
        total = math.fsum(ratios.values())
        row = {
            "none": True,
            "sequence_mask_sum": low <= math.exp(total) <= high,
            "sequence_mask_mean": low <= math.exp(total / len(policy)) <= high,
        }
        kept.append(
            [
                t in ratios
                and (
                    low <= math.exp(ratios[t]) <= high
                    if correction == "token_mask"
                    else row[correction]
                )
                for t in range(mask.shape[1])
            ]
        )
    return kept


SETTINGS = [  # eps_low, eps_high, correction
    (0.2, 0.2, "none"),
    (0.2, 0.28, "token_mask"),
    (0.0, 0.0, "sequence_mask_mean"),
    (0.2, 0.28, "sequence_mask_sum"),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_random_batches_match_reference(seed, aggregation):
    clipped_any = 0
    log_probs, behavior, advantages, mask = random_batch(seed)
    for eps_low, eps_high, correction in SETTINGS:
        lp = log_probs.clone().requires_grad_(True)
        loss, metrics = loss_of(
            lp,
            behavior,
            advantages,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            aggregation=aggregation,
            correction=correction,
            correction_low=0.7,
            correction_high=1.4,
        )
        loss.backward()
        kept = kept_tokens(log_probs, behavior, mask, correction, 0.7, 1.4)
        expected_loss, expected_grad, clipped = reference(
            log_probs, behavior, advantages, mask, eps_low, eps_high, aggregation, kept
        )
        assert abs(loss.item() - expected_loss) <= 1e-10
        assert_close(lp.grad, expected_grad, atol=1e-10)
        assert int(metrics["clipped_tokens"]) == clipped
        assert int(metrics["policy_tokens"]) == int(mask.sum())
        assert metrics["admitted"].tolist() == [any(row) for row in kept]
        assert metrics["retained_per_trajectory"].tolist() == [sum(row) for row in kept]
        clipped_any += clipped
    # eps = 0 clips every token on one side of ratio 1, so the clipped branch is exercised.
    assert clipped_any > 0


def test_single_token_by_hand():
    """ratio 1.5 and 0.5, A = +-1, eps 0.2: the four cases of min(r A, clip(r) A)."""
    old = torch.log(torch.tensor([[0.4], [0.4], [0.4], [0.4]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.6], [0.6], [0.2], [0.2]], dtype=torch.float64))
    lp.requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, metrics = loss_of(lp, old, advantages, mask, aggregation="sequence_mean")
    loss.backward()
    # Per token: -1.2 (clipped), +1.5, -0.5, +0.8 (clipped); gradients 0, 1.5, -0.5, 0 over B.
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4, abs=1e-12)
    expected_grad = torch.tensor([[0.0], [1.5], [-0.5], [0.0]], dtype=torch.float64) / 4
    assert_close(lp.grad, expected_grad, atol=1e-12)
    assert int(metrics["clipped_tokens"]) == 2
    assert metrics["ratio_max"].item() == pytest.approx(1.5)


def test_the_three_aggregations_weigh_rows_differently():
    """Rows of 1 and 3 tokens at ratio 1, A = +1 and -1: token losses -1 | 1 1 1."""
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    losses = {a: loss_of(lp, lp, advantages, mask, aggregation=a)[0].item() for a in AGGREGATIONS}
    assert losses["token_mean"] == pytest.approx((-1 + 3) / 4)
    assert losses["sequence_mean"] == pytest.approx((-1 / 1 + 3 / 3) / 2)
    assert losses["token_sum_norm"] == pytest.approx((-1 + 3) / (2 * 3))


def test_padding_garbage_changes_nothing():
    log_probs, behavior, advantages, mask = random_batch(3)
    clean, _ = loss_of(log_probs, behavior, advantages, mask)
    dirty = [x.clone() for x in (log_probs, behavior)]
    for tensor, junk in zip(dirty, (math.nan, math.inf), strict=True):
        tensor[~mask] = junk
    lp = dirty[0].requires_grad_(True)
    loss, _ = loss_of(lp, dirty[1], advantages, mask)
    loss.backward()
    assert loss.item() == clean.item() and torch.isfinite(lp.grad).all()


def test_only_the_log_probs_get_a_gradient():
    log_probs, behavior, advantages, mask = random_batch(8)
    behavior.requires_grad_(True)
    advantages.requires_grad_(True)
    lp = log_probs.clone().requires_grad_(True)
    loss, metrics = loss_of(lp, behavior, advantages, mask, correction="token_mask")
    loss.backward()
    assert behavior.grad is None and advantages.grad is None and lp.grad is not None
    assert not any(m.requires_grad for m in metrics.values())


def test_float32_matches_float64_reference():
    log_probs, behavior, advantages, mask = random_batch(12)
    loss, _ = loss_of(log_probs.float(), behavior.float(), advantages.float(), mask)
    kept = kept_tokens(log_probs, behavior, mask, "none", 0, math.inf)
    expected, *_ = reference(log_probs, behavior, advantages, mask, 0.2, 0.2, "token_mean", kept)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_ratio_overflow_on_a_policy_token_raises():
    old = torch.tensor([[-200.0, -0.1]])
    lp = torch.tensor([[-1e-3, -0.1]])
    with pytest.raises(RatioOverflowError, match="overflows on a policy token"):
        loss_of(lp, old, torch.tensor([-1.0]), torch.tensor([[True, True]]))
    loss, _ = loss_of(lp, old, torch.tensor([-1.0]), torch.tensor([[False, True]]))
    assert loss.item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(log_probs=lambda x: x[:, :-1]), "has shape"),
        (dict(behavior=lambda x: x.float()), "dtype mismatch"),
        (dict(log_probs=lambda x: x.long()), "log_probs must be a floating-point"),
        (dict(mask=lambda m: m.float()), "action_mask must be torch.bool"),
        (dict(behavior=lambda x: x + 1), "behavior_log_probs has positive values"),
        (dict(log_probs=lambda x: x * math.nan), "log_probs has non-finite"),
        (dict(advantages=lambda a: a[:, None]), r"advantages must be \[B\]"),
        (dict(advantages=lambda a: a * math.inf), "advantages are non-finite"),
        (dict(advantages=lambda a: a.long()), "advantages must be a floating-point"),
        (dict(counts=lambda c: c[:-1]), "token_counts has shape"),
        (dict(segments=lambda s: s + 1), "segment_ids of policy tokens"),
    ],
)
def test_bad_inputs_are_refused(change, message):
    log_probs, behavior, advantages, mask = random_batch(2, batch=3, length=4)
    args = dict(
        log_probs=log_probs,
        behavior=behavior,
        advantages=advantages,
        mask=mask,
        segments=torch.where(mask, torch.arange(3)[:, None], -1),
        counts=mask.sum(1),
    )
    args.update({key: make(args[key]) for key, make in change.items()})
    with pytest.raises(ValueError, match=message):
        ppo_clip_loss(
            args["log_probs"],
            args["behavior"],
            args["advantages"],
            args["mask"],
            args["segments"],
            args["counts"],
            PPOClipConfig(aggregation="token_mean"),
        )


def test_an_unresolved_aggregation_is_refused():
    log_probs, behavior, advantages, mask = random_batch(2)
    with pytest.raises(ValueError, match="aggregation is unset"):
        loss_of(log_probs, behavior, advantages, mask, aggregation=None)


def test_the_gates_sequence_kl_is_reported_without_gating():
    """GRPO and RLOO log the same engine-learner mismatch as FlashREINFORCE: per trajectory
    the mean over its policy tokens of p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(mu),
    q = exp(pi), written out here; it decides nothing (every trajectory stays admitted)."""
    log_probs, behavior, advantages, mask = random_batch(5, batch=3, length=6)
    _, metrics = loss_of(log_probs, behavior, advantages, mask)
    expected = []
    for i in range(3):
        p, q = behavior[i][mask[i]].exp(), log_probs[i][mask[i]].exp()
        d = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
        expected.append(d.mean().clamp_min(0))
    assert_close(metrics["sequence_kl"], torch.stack(expected), 1e-12)
    assert metrics["admitted"].all() and min(expected) > 0
