"""ppo_clip_loss against a token-by-token Python loop and a written-out gradient formula."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, log_sigmoid, random_policy_mask

from megatron_fr.algo.flash_reinforce import RatioOverflowError
from megatron_fr.algo.ppo import ppo_clip_loss


def random_batch(seed, token_advantages=False, dtype=torch.float64, batch=None, length=None):
    """Ratios spread over roughly [0.3, 3], so that both clip edges are hit."""
    gen = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(1, 7, (1,), generator=gen))
    length = length or int(torch.randint(1, 11, (1,), generator=gen))
    mask = random_policy_mask(gen, batch, length)
    old_logit = torch.randn(batch, length, generator=gen, dtype=dtype) * 2
    log_probs = log_sigmoid(old_logit + torch.randn(batch, length, generator=gen, dtype=dtype))
    old_log_probs = log_sigmoid(old_logit)
    shape = (batch, length) if token_advantages else (batch,)
    advantages = torch.randn(shape, generator=gen, dtype=dtype)
    weights = torch.rand(batch, length, generator=gen, dtype=dtype) * 2
    weights[torch.rand(batch, length, generator=gen) < 0.2] = 0
    return log_probs, old_log_probs, advantages, mask, weights


def reference(log_probs, old_log_probs, advantages, mask, eps_low, eps_high, aggregation, weights):
    """(loss, d loss / d log_probs, metrics), token by token in Python floats.

    The gradient of -min(r A, clip(r) A) * w is -A r w where r A is the minimum (the unclipped
    branch), 0 where the clipped branch is: for A > 0 above 1 + eps_high, for A < 0 below
    1 - eps_low. Divided by the aggregation's normaliser.
    """
    batch, length = mask.shape
    total_tokens = int(mask.sum())
    loss, grad = 0.0, torch.zeros(batch, length, dtype=torch.float64)
    ratios, clipped_count = [], 0
    for i in range(batch):
        row_tokens = int(mask[i].sum())
        scale = 1 / total_tokens if aggregation == "token_mean" else 1 / (batch * row_tokens)
        for t in range(length):
            if not mask[i, t]:
                continue
            r = math.exp(log_probs[i, t].item() - old_log_probs[i, t].item())
            a = (advantages[i, t] if advantages.dim() == 2 else advantages[i]).item()
            w = 1.0 if weights is None else weights[i, t].item()
            objective = min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            loss += -objective * w * scale
            clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            grad[i, t] = 0.0 if clipped else -a * r * w * scale
            ratios.append(r)
            clipped_count += clipped
    metrics = {
        "clip_fraction": clipped_count / len(ratios),
        "approx_kl": sum((r - 1) - math.log(r) for r in ratios) / len(ratios),
        "ratio_mean": sum(ratios) / len(ratios),
        "ratio_max": max(ratios),
    }
    return loss, grad, metrics


def check_against_reference(batch, eps_low, eps_high, aggregation, use_weights):
    log_probs, old_log_probs, advantages, mask, weights = batch
    weights = weights if use_weights else None
    lp = log_probs.clone().requires_grad_(True)
    loss, metrics = ppo_clip_loss(
        lp,
        old_log_probs,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        correction_weights=weights,
    )
    loss.backward()
    expected_loss, expected_grad, expected_metrics = reference(
        log_probs, old_log_probs, advantages, mask, eps_low, eps_high, aggregation, weights
    )
    assert abs(loss.item() - expected_loss) <= 1e-10
    assert_close(lp.grad, expected_grad, atol=1e-10)
    for name, value in expected_metrics.items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-12), name
    return metrics


@pytest.mark.parametrize("seed", range(15))
@pytest.mark.parametrize("aggregation", ["token_mean", "sample_mean"])
def test_random_batches_match_reference(seed, aggregation):
    clip_fractions = []
    for token_advantages in (False, True):
        batch = random_batch(seed, token_advantages)
        for eps_low, eps_high, use_weights in [(0.2, 0.2, False), (0.2, 0.28, True), (0, 0, False)]:
            metrics = check_against_reference(batch, eps_low, eps_high, aggregation, use_weights)
            clip_fractions.append(metrics["clip_fraction"].item())
    # eps = 0 clips every token on one side of ratio 1, so the clipped branch is exercised.
    assert max(clip_fractions) > 0


def test_single_token_by_hand():
    """ratio 1.5 and 0.5, A = +-1, eps 0.2: the four cases of min(r A, clip(r) A)."""
    old = torch.log(torch.tensor([[0.4], [0.4], [0.4], [0.4]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.6], [0.6], [0.2], [0.2]], dtype=torch.float64))
    lp.requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, metrics = ppo_clip_loss(lp, old, advantages, mask, aggregation="sample_mean")
    loss.backward()
    # Per token: -1.2 (clipped), +1.5, -0.5, +0.8 (clipped); gradients 0, 1.5, -0.5, 0 over B.
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4, abs=1e-12)
    expected_grad = torch.tensor([[0.0], [1.5], [-0.5], [0.0]], dtype=torch.float64) / 4
    assert_close(lp.grad, expected_grad, atol=1e-12)
    assert metrics["clip_fraction"].item() == 0.5
    assert metrics["ratio_max"].item() == pytest.approx(1.5)


def test_token_mean_and_sample_mean_weigh_rows_differently():
    """Rows of 1 and 3 tokens at ratio 1, A = +1 and -1: token losses -1 | 1 1 1."""
    lp = torch.full((2, 3), -1.0, dtype=torch.float64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)
    token_mean, _ = ppo_clip_loss(lp, lp, advantages, mask, aggregation="token_mean")
    sample_mean, _ = ppo_clip_loss(lp, lp, advantages, mask, aggregation="sample_mean")
    assert token_mean.item() == pytest.approx((-1 + 3) / 4)
    assert sample_mean.item() == pytest.approx((-1 + 1) / 2)


def test_padding_garbage_changes_nothing():
    log_probs, old_log_probs, advantages, mask, weights = random_batch(3, token_advantages=True)
    clean = check_against_reference(
        (log_probs, old_log_probs, advantages, mask, weights), 0.2, 0.2, "token_mean", True
    )
    dirty = [x.clone() for x in (log_probs, old_log_probs, advantages, weights)]
    for tensor, junk in zip(dirty, (math.nan, math.inf, math.nan, -math.inf), strict=True):
        tensor[~mask] = junk
    lp = dirty[0].requires_grad_(True)
    loss, metrics = ppo_clip_loss(
        lp, dirty[1], dirty[2], mask, correction_weights=dirty[3], aggregation="token_mean"
    )
    loss.backward()
    expected_loss, expected_grad, _ = reference(
        log_probs, old_log_probs, advantages, mask, 0.2, 0.2, "token_mean", weights
    )
    assert abs(loss.item() - expected_loss) <= 1e-10
    assert_close(lp.grad, expected_grad, atol=1e-10)
    assert metrics["ratio_mean"].item() == clean["ratio_mean"].item()


def test_correction_weights_and_old_log_probs_get_no_gradient():
    log_probs, old_log_probs, advantages, mask, weights = random_batch(8)
    weights.requires_grad_(True)
    old_log_probs.requires_grad_(True)
    advantages.requires_grad_(True)
    loss, _ = ppo_clip_loss(log_probs, old_log_probs, advantages, mask, correction_weights=weights)
    assert not loss.requires_grad
    lp = log_probs.clone().requires_grad_(True)
    loss, metrics = ppo_clip_loss(lp, old_log_probs, advantages, mask, correction_weights=weights)
    loss.backward()
    assert weights.grad is None and old_log_probs.grad is None and advantages.grad is None
    assert lp.grad is not None and not any(m.requires_grad for m in metrics.values())


def test_float32_matches_float64_reference():
    log_probs, old_log_probs, advantages, mask, _ = random_batch(12)
    loss, _ = ppo_clip_loss(log_probs.float(), old_log_probs.float(), advantages.float(), mask)
    expected, *_ = reference(
        log_probs, old_log_probs, advantages, mask, 0.2, 0.2, "token_mean", None
    )
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def test_ratio_overflow_on_a_policy_token_raises():
    old = torch.tensor([[-200.0, -0.1]])
    lp = torch.tensor([[-1e-3, -0.1]])
    mask = torch.tensor([[True, True]])
    with pytest.raises(RatioOverflowError, match="overflows on a policy token"):
        ppo_clip_loss(lp, old, torch.tensor([-1.0]), mask)
    loss, _ = ppo_clip_loss(lp, old, torch.tensor([-1.0]), torch.tensor([[False, True]]))
    assert loss.item() == pytest.approx(1.0)


def _good():
    log_probs, old_log_probs, advantages, mask, _ = random_batch(2, batch=3, length=4)
    return dict(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, mask=mask)


def _call(**overrides):
    args = _good()
    for key, make in overrides.items():
        args[key] = make(args[key]) if callable(make) else make
    kwargs = {k: args.pop(k) for k in list(args) if k not in _good()}
    return ppo_clip_loss(
        args["log_probs"], args["old_log_probs"], args["advantages"], args["mask"], **kwargs
    )


def _empty_first_row(mask):
    mask = mask.clone()
    mask[0] = False
    return mask


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(log_probs=lambda x: x[:, :-1]), "log_probs has shape"),
        (dict(old_log_probs=lambda x: x.float()), "dtype mismatch"),
        (dict(log_probs=lambda x: x.long()), "log_probs must be a floating-point"),
        (dict(mask=lambda m: m.float()), "action_mask must be torch.bool"),
        (dict(mask=lambda m: m[None]), r"action_mask must be \[B, T\]"),
        (dict(mask=_empty_first_row), r"trajectory \[0\] has no policy tokens"),
        (dict(log_probs=lambda x: x + 1), "log_probs has positive values"),
        (dict(old_log_probs=lambda x: x * math.nan), "old_log_probs has non-finite"),
        (dict(advantages=lambda a: a[:-1]), r"advantages must be \[B\]"),
        (dict(advantages=lambda a: a[:, None]), r"advantages must be \[B\]"),
        (dict(advantages=lambda a: a * math.inf), "advantages has non-finite values"),
        (dict(advantages=lambda a: a.long()), "advantages must be a floating-point"),
        (dict(eps_low=-0.1), "eps_low must be >= 0"),
        (dict(eps_high=math.nan), "eps_high must be >= 0"),
        (dict(aggregation="seq_mean"), r"unknown aggregation 'seq_mean'"),
        (dict(correction_weights=torch.ones(1, 1, dtype=torch.float64)), "correction_weights has"),
        (
            dict(correction_weights=-torch.ones(3, 4, dtype=torch.float64)),
            "correction_weights must be finite and >= 0",
        ),
        (dict(correction_weights=torch.ones(3, 4, dtype=torch.long)), "floating-point"),
    ],
)
def test_bad_inputs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_parallel_loss_reports_the_gates_sequence_kl_without_gating():
    """GRPO and RLOO log the same engine-learner mismatch as FlashREINFORCE: per trajectory
    the mean over its policy tokens of p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(mu),
    q = exp(pi), written out here; it decides nothing (every trajectory stays admitted)."""
    from megatron_fr.config.algo import PPOClipConfig
    from megatron_fr.parallel.loss import GlobalBatch, LossBatch
    from megatron_fr.parallel.ppo_loss import ppo_clip_parallel_loss

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 6, 5, generator=generator, dtype=torch.float64)
    targets = torch.tensor([[1, 2, 3, 0, 4, 1]])
    behavior = torch.log_softmax(logits + 0.5 * torch.randn(logits.shape, generator=generator,
                                                            dtype=torch.float64), -1)  # fmt: skip
    behavior = behavior.gather(-1, targets[..., None])[..., 0]
    mask = torch.tensor([[False, True, True, False, True, True]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])  # two packed trajectories
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    batch = LossBatch(target_ids=targets, behavior_log_probs=behavior, action_mask=mask,
                      segment_ids=segments, positions=positions)  # fmt: skip
    global_batch = GlobalBatch(advantages=torch.tensor([0.5, -0.5]),
                               token_counts=torch.tensor([2, 2]))  # fmt: skip
    _, metrics = ppo_clip_parallel_loss(logits, batch, global_batch, PPOClipConfig())
    pi = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[0, :, 0]
    p, q = behavior[0].exp(), pi.exp()
    d = p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
    expected = torch.stack([d[1:3].mean(), d[4:6].mean()])
    assert_close(metrics["sequence_kl"], expected, 1e-12)
    assert metrics["admitted"].all() and expected.min() > 0
