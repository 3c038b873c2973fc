"""flash_reinforce_loss against a written-out, loop-by-loop implementation of docs/algorithm.md."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import log_sigmoid, random_policy_mask

from megatron_fr.algo.flash_reinforce import RatioOverflowError, flash_reinforce_loss

CLAMP = 1e-6


def reference_loss(pi, mu, rewards, mask, delta, q=1.0, entropies=None, failures=None):
    """docs/algorithm.md steps 1-5 with Python loops; rho enters as a constant (detached)."""
    batch = len(rewards)
    mean_reward = sum(rewards.tolist()) / batch
    total = pi.sum() * 0.0
    kls, admitted = [], []
    for i in range(batch):
        policy = [t for t in range(mask.shape[1]) if mask[i, t]]
        length = len(policy)
        kl = 0.0
        for t in policy:
            p = min(max(math.exp(mu[i, t].item()), CLAMP), 1 - CLAMP)
            qq = min(max(math.exp(pi[i, t].item()), CLAMP), 1 - CLAMP)
            kl += p * math.log(p / qq) + (1 - p) * math.log((1 - p) / (1 - qq))
        kl = max(0.0, kl / length)
        kls.append(kl)
        admitted.append(kl <= delta)
        kept = policy
        if q < 1.0 and failures[i]:
            by_entropy = sorted(policy, key=lambda t, i=i: (-entropies[i, t].item(), t))
            kept = by_entropy[: math.ceil(round(q * length, 9))]
        if admitted[-1]:
            advantage = rewards[i].item() - mean_reward
            for t in kept:
                rho = math.exp(pi[i, t].item() - mu[i, t].item())
                total = total + advantage / length * rho * pi[i, t]
    return -total / batch, kls, admitted


def random_batch(seed, dtype=torch.float64, batch=None, length=None):
    gen = torch.Generator().manual_seed(seed)
    batch = batch or int(torch.randint(1, 9, (1,), generator=gen))
    length = length or int(torch.randint(1, 13, (1,), generator=gen))
    mask = random_policy_mask(gen, batch, length)
    behavior_logit = torch.randn(batch, length, generator=gen, dtype=dtype) * 2
    # Per-row drift: some rows barely move (admitted), others move a lot (rejected).
    drift = torch.rand(batch, 1, generator=gen, dtype=dtype) ** 3 * 2
    policy_logit = behavior_logit + drift * torch.randn(batch, length, generator=gen, dtype=dtype)
    mu = log_sigmoid(behavior_logit)
    pi = log_sigmoid(policy_logit)
    rewards = torch.randn(batch, generator=gen, dtype=dtype)
    entropies = torch.rand(batch, length, generator=gen, dtype=dtype).round(decimals=1)
    failures = torch.rand(batch, generator=gen) < 0.5
    return pi, mu, rewards, mask, entropies, failures


def threshold_between(pi, mu, rewards, mask, admitted_count):
    """A delta admitting exactly the `admitted_count` lowest-KL rows, halfway between two D_i
    (a delta equal to some D_i would make the decision hinge on the last bit of rounding)."""
    kls = [*sorted(reference_loss(pi, mu, rewards, mask, math.inf)[1]), math.inf]
    if admitted_count == 0:
        return kls[0] / 2
    return (kls[admitted_count - 1] + kls[admitted_count]) / 2


def assert_matches_reference(pi, mu, rewards, mask, delta, q=1.0, entropies=None, failures=None):
    pi_lib = pi.clone().requires_grad_(True)
    pi_ref = pi.clone().requires_grad_(True)
    loss, metrics = flash_reinforce_loss(
        pi_lib,
        mu,
        rewards,
        mask,
        delta=delta,
        negative_token_fraction=q,
        entropies=entropies,
        failures=failures,
    )
    expected, kls, admitted = reference_loss(
        pi_ref, mu, rewards, mask, delta, q, entropies, failures
    )
    loss.backward()
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-10
    torch.testing.assert_close(pi_lib.grad, pi_ref.grad, rtol=0, atol=1e-10)
    assert metrics["admitted"].tolist() == admitted
    torch.testing.assert_close(
        metrics["sequence_kl"], torch.tensor(kls, dtype=pi.dtype), rtol=0, atol=1e-12
    )
    assert metrics["acceptance_rate"].item() == pytest.approx(sum(admitted) / len(admitted))
    torch.testing.assert_close(metrics["advantages"], rewards - rewards.mean())
    return loss, metrics


@pytest.mark.parametrize("seed", range(40))
def test_random_batches_match_reference(seed):
    pi, mu, rewards, mask, entropies, failures = random_batch(seed)
    # delta = 0 is covered by its own test: on random data it would hinge on rounding.
    for delta in (math.inf, 3e-3, threshold_between(pi, mu, rewards, mask, len(pi) // 2)):
        assert_matches_reference(pi, mu, rewards, mask, delta)
    for q in (0.0, 0.3, 0.5, 0.9):
        assert_matches_reference(pi, mu, rewards, mask, math.inf, q, entropies, failures)


def test_gate_splits_a_batch_and_rejected_rows_keep_the_denominator():
    pi, mu, rewards, mask, *_ = random_batch(7, batch=8, length=10)
    delta = threshold_between(pi, mu, rewards, mask, 4)
    _, metrics = assert_matches_reference(pi, mu, rewards, mask, delta)
    assert 0 < metrics["acceptance_rate"].item() < 1


def test_delta_zero_admits_only_exact_matches():
    pi, mu, rewards, mask, *_ = random_batch(3, batch=4, length=6)
    pi[1] = mu[1]
    _, metrics = assert_matches_reference(pi, mu, rewards, mask, 0.0)
    assert metrics["admitted"][1]


def test_all_rejected_batch_has_zero_loss_and_gradient():
    pi, mu, rewards, mask, *_ = random_batch(11, batch=5, length=8)
    pi = log_sigmoid(torch.logit(mu.exp()) + 3.0)
    pi_grad = pi.clone().requires_grad_(True)
    loss, metrics = flash_reinforce_loss(pi_grad, mu, rewards, mask, delta=1e-4)
    loss.backward()
    assert metrics["acceptance_rate"].item() == 0
    assert loss.item() == 0
    assert torch.count_nonzero(pi_grad.grad) == 0


def test_single_trajectory_has_zero_advantage():
    pi, mu, rewards, mask, *_ = random_batch(5, batch=1, length=7)
    loss, metrics = assert_matches_reference(pi, mu, rewards, mask, math.inf)
    assert metrics["advantages"].item() == 0 and loss.item() == 0


def test_gradient_is_the_weighted_ratio():
    """dL/dpi_{i,t} = -(1/B) m_i A_i / T_i * rho_{i,t}: checked on a hand-sized batch."""
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.8, 0.9, 0.6]], dtype=torch.float64))
    pi = torch.log(torch.tensor([[0.6, 0.2, 0.1], [0.8, 0.9, 0.7]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards = torch.tensor([1.0, -1.0], dtype=torch.float64)
    pi.requires_grad_(True)
    loss, _ = flash_reinforce_loss(pi, mu, rewards, mask, delta=math.inf)
    loss.backward()
    rho = (pi.detach() - mu).exp()
    expected = torch.stack([-(1 / 2) * 1.0 / 2 * rho[0], -(1 / 2) * -1.0 / 3 * rho[1]])
    expected[0, 2] = 0
    torch.testing.assert_close(pi.grad, expected, rtol=0, atol=1e-12)


def test_float32_matches_float64_reference():
    pi, mu, rewards, mask, *_ = random_batch(21, batch=6, length=9)
    loss32, _ = flash_reinforce_loss(pi.float(), mu.float(), rewards.float(), mask, delta=math.inf)
    expected, *_ = reference_loss(pi, mu, rewards, mask, math.inf)
    assert loss32.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_are_computed_in_float32_as_the_reference_loss_is(dtype):
    """The loss of bfloat16 / float16 log-probs is float32 arithmetic on those values: it
    equals the float64 reference of the same (rounded) numbers to float32's precision, where
    arithmetic in the half type would be off by ~1e-3 relative; the gradient comes back in
    the model's dtype."""
    pi, mu, rewards, mask, *_ = random_batch(5, batch=8, length=12)
    pi_half, mu_half = pi.to(dtype), mu.to(dtype)
    leaf = pi_half.clone().requires_grad_(True)
    loss, _ = flash_reinforce_loss(leaf, mu_half, rewards.to(dtype), mask, delta=math.inf)
    expected, *_ = reference_loss(
        pi_half.double(), mu_half.double(), rewards.to(dtype), mask, math.inf
    )
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    loss.backward()
    assert leaf.grad is not None and leaf.grad.dtype == dtype


def test_retained_tokens_are_reported_per_trajectory():
    """retained_per_trajectory: each admitted row's kept policy tokens, 0 for a row the gate
    holds out, summing to retained_tokens (counted here from the mask and the decisions)."""
    pi, mu, rewards, mask, entropies, failures = random_batch(3, batch=8, length=10)
    delta = threshold_between(pi, mu, rewards, mask, 4)
    _, metrics = flash_reinforce_loss(pi, mu, rewards, mask, delta=delta)
    expected = [int(mask[i].sum()) if metrics["admitted"][i] else 0 for i in range(8)]
    assert metrics["retained_per_trajectory"].tolist() == expected
    assert 0 < sum(expected) == int(metrics["retained_tokens"])
    _, filtered = flash_reinforce_loss(
        pi,
        mu,
        rewards,
        mask,
        delta=math.inf,
        negative_token_fraction=0.5,
        entropies=entropies,
        failures=failures,
    )
    kept = [
        math.ceil(round(0.5 * int(mask[i].sum()), 9)) if failures[i] else int(mask[i].sum())
        for i in range(8)
    ]
    assert filtered["retained_per_trajectory"].tolist() == kept


def test_ratio_overflow_on_admitted_token_raises_and_rejected_one_does_not():
    mu = torch.tensor([[-200.0, -0.1]])
    pi = torch.tensor([[-1e-3, -0.1]])
    mask = torch.tensor([[True, True]])
    rewards = torch.tensor([1.0])
    with pytest.raises(RatioOverflowError, match="overflows on an admitted token"):
        flash_reinforce_loss(pi, mu, rewards, mask, delta=math.inf)
    loss, metrics = flash_reinforce_loss(pi, mu, rewards, mask, delta=1e-3)
    assert not metrics["admitted"][0] and loss.item() == 0


def _good():
    pi, mu, rewards, mask, *_ = random_batch(2, batch=3, length=4)
    return dict(log_probs=pi, behavior_log_probs=mu, rewards=rewards, action_mask=mask)


def _call(**overrides):
    args = _good()
    kwargs = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return flash_reinforce_loss(**args, **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(log_probs=torch.zeros(3, 5)), "log_probs has shape"),
        (dict(behavior_log_probs=torch.zeros(3, 4)), "dtype mismatch"),
        (dict(log_probs=torch.zeros(3, 4, dtype=torch.long)), "floating-point"),
        (dict(action_mask=torch.ones(3, 4)), "action_mask must be torch.bool"),
        (dict(action_mask=torch.tensor([[True] * 4, [False] * 4, [True] * 4])), "no policy tokens"),
        (dict(action_mask=torch.zeros(0, 4, dtype=torch.bool)), "empty"),
        (dict(log_probs=torch.full((3, 4), math.nan, dtype=torch.float64)), "non-finite"),
        (dict(log_probs=torch.full((3, 4), 0.5, dtype=torch.float64)), "positive values"),
        (dict(behavior_log_probs=torch.full((3, 4), 0.1, dtype=torch.float64)), "behavior_log"),
        (dict(rewards=torch.tensor([1.0, math.inf, 0.0], dtype=torch.float64)), "non-finite at"),
        (dict(rewards=torch.zeros(2, dtype=torch.float64)), "expected B = 3"),
        (dict(delta=-1e-3), "delta must be >= 0"),
        (dict(delta=math.nan), "delta must be >= 0"),
        (dict(negative_token_fraction=1.5), r"q must be in \[0, 1\]"),
        (dict(negative_token_fraction=-0.1), r"q must be in \[0, 1\]"),
        (dict(negative_token_fraction=0.5), "needs both entropies and failures"),
        (
            dict(
                negative_token_fraction=0.5,
                entropies=torch.zeros(3, 4, dtype=torch.float64),
                failures=torch.zeros(3),
            ),
            "failures must be bool",
        ),
    ],
)
def test_bad_input_is_refused_with_a_named_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        _call(**overrides)


def test_padding_values_outside_the_mask_are_ignored():
    args = _good()
    pi = args["log_probs"].clone()
    pi[~args["action_mask"]] = math.nan
    loss, _ = flash_reinforce_loss(
        pi, args["behavior_log_probs"], args["rewards"], args["action_mask"]
    )
    assert math.isfinite(loss.item())


def reference_topk_kl(behavior: list[float], current: list[float]) -> float:
    """The top-K KL written out: buckets = the K ids, then the rest of the vocabulary (one
    minus the K probabilities), every bucket clamped to [1e-6, 1 - 1e-6] on both sides."""
    p = [math.exp(lp) for lp in behavior]
    q = [math.exp(lp) for lp in current]
    p, q = [*p, 1 - sum(p)], [*q, 1 - sum(q)]
    p = [min(max(x, CLAMP), 1 - CLAMP) for x in p]
    q = [min(max(x, CLAMP), 1 - CLAMP) for x in q]
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def test_topk_kl_is_the_k_plus_one_bucket_kl_and_the_bernoulli_proxy_at_k_1():
    from megatron_fr.algo.flash_reinforce import bernoulli_kl, topk_kl

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, 30, generator=generator, dtype=torch.float64)
    mu_all = torch.log_softmax(logits, -1)
    pi_all = torch.log_softmax(
        logits + 0.3 * torch.randn(logits.shape, generator=generator, dtype=torch.float64), -1
    )
    for k in (1, 4, 30):  # K = V: the tail is empty (clamped to 1e-6 on both sides)
        ids = mu_all.topk(k, -1).indices
        mu, pi = mu_all.gather(-1, ids), pi_all.gather(-1, ids)
        got = topk_kl(mu, pi)
        assert got.shape == (6, 9)
        expected = [
            [reference_topk_kl(mu[i, t].tolist(), pi[i, t].tolist()) for t in range(9)]
            for i in range(6)
        ]
        assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-12)
        if k == 1:
            assert torch.allclose(got, bernoulli_kl(mu[..., 0], pi[..., 0]), atol=1e-12)
    same = topk_kl(mu, mu)
    assert same.abs().max() <= 1e-15, "no shift, no divergence"
    floor = torch.full((1, 3), torch.finfo(torch.float32).min, dtype=torch.float64)
    assert torch.isfinite(topk_kl(floor, torch.log(torch.full((1, 3), 0.2)))).all()


def test_sequence_gate_on_the_bernoulli_proxy_is_the_papers_gate():
    from megatron_fr.algo.flash_reinforce import bernoulli_kl, sequence_gate, trust_region_gate

    generator = torch.Generator().manual_seed(1)
    mask = random_policy_mask(generator, 5, 12)
    pi = log_sigmoid(torch.randn(5, 12, generator=generator, dtype=torch.float64))
    mu = log_sigmoid(torch.randn(5, 12, generator=generator, dtype=torch.float64))
    segments = torch.arange(5)[:, None].expand(5, 12)
    paper = trust_region_gate(pi, mu, mask, segments, 5, 0.15)
    ours = sequence_gate(bernoulli_kl(mu, pi), mask, segments, 5, 0.15)
    assert torch.equal(paper.sequence_kl, ours.sequence_kl)
    assert torch.equal(paper.admitted, ours.admitted) and 0 < int(ours.admitted.sum()) < 5
