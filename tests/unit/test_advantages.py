"""Advantage estimators against per-group Python loops written from their formulas."""

from __future__ import annotations

import math
import statistics
from typing import get_args

import pytest
import torch
from helpers import assert_close

from megatron_fr.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
)

GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_baseline"]
EPS = 1e-6


def reference_advantages(estimator, rewards, group_index, eps=EPS):
    """The formulas of docs/algorithm.md, one group at a time, in Python floats (float64)."""
    r = rewards.tolist()
    if estimator == "flash_reinforce":
        mean = statistics.fmean(r)
        return [x - mean for x in r]
    members = {}
    for i, g in enumerate(group_index.tolist()):
        members.setdefault(g, []).append(i)
    out = [math.nan] * len(r)
    for idx in members.values():
        values = [r[i] for i in idx]
        size, total, mean = len(values), math.fsum(values), statistics.fmean(values)
        std = statistics.stdev(values)
        for i in idx:
            out[i] = {
                "grpo": (r[i] - mean) / (std + eps),
                "dr_grpo": r[i] - mean,
                "rloo": r[i] - (total - r[i]) / (size - 1),
                "reinforce_baseline": r[i] - mean,
            }[estimator]
    if estimator == "reinforce_baseline":
        mean, std = statistics.fmean(out), statistics.pstdev(out)
        out = [(x - mean) / (std + eps) for x in out]
    return out


def grouped_batch(seed, dtype=torch.float64):
    """Groups of 2..5 rollouts with arbitrary (negative, sparse) ids, shuffled together.

    Odd seeds use 0/1 rewards, so that some groups are constant (std = 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_groups = int(torch.randint(1, 7, (1,), generator=gen))
    sizes = torch.randint(2, 6, (num_groups,), generator=gen)
    ids = torch.randperm(1000, generator=gen)[:num_groups] * 7 - 3000
    pairs = zip(ids.tolist(), sizes.tolist(), strict=True)
    group_index = torch.tensor([g for g, size in pairs for _ in range(size)])
    group_index = group_index[torch.randperm(group_index.numel(), generator=gen)]
    if seed % 2:
        rewards = (torch.rand(group_index.numel(), generator=gen) < 0.5).to(dtype)
    else:
        rewards = torch.randn(group_index.numel(), generator=gen, dtype=dtype) * 3 + 1
    return rewards, group_index


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("seed", range(10))
def test_random_grouped_batches_match_reference(estimator, seed):
    rewards, group_index = grouped_batch(seed)
    advantages = compute_advantages(estimator, rewards, group_index)
    expected = torch.tensor(
        reference_advantages(estimator, rewards, group_index), dtype=torch.float64
    )
    assert advantages.dtype == torch.float64
    assert_close(advantages, expected, atol=1e-12)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_float32_rewards_give_float32_advantages_close_to_float64(estimator):
    rewards, group_index = grouped_batch(4)
    advantages = compute_advantages(estimator, rewards.float(), group_index)
    expected = torch.tensor(
        reference_advantages(estimator, rewards.double(), group_index), dtype=torch.float64
    )
    assert advantages.dtype == torch.float32
    assert_close(advantages.double(), expected, atol=1e-5)


# Rewards [1, 0, 3, 4] in groups 5 = {0, 2} and -2 = {1, 3}: both group means are 2, the
# sample stds are sqrt(2) and sqrt(8), the population std of [-1, -2, 1, 2] is sqrt(2.5).
HAND_REWARDS = torch.tensor([1.0, 0.0, 3.0, 4.0], dtype=torch.float64)
HAND_GROUPS = torch.tensor([5, -2, 5, -2])
HAND_EXPECTED = {
    "flash_reinforce": [-1.0, -2.0, 1.0, 2.0],
    "dr_grpo": [-1.0, -2.0, 1.0, 2.0],
    "grpo": [-1 / math.sqrt(2), -2 / math.sqrt(8), 1 / math.sqrt(2), 2 / math.sqrt(8)],
    "rloo": [1.0 - 3.0, 0.0 - 4.0, 3.0 - 1.0, 4.0 - 0.0],
    "reinforce_baseline": [x / math.sqrt(2.5) for x in (-1.0, -2.0, 1.0, 2.0)],
}


@pytest.mark.parametrize("estimator", sorted(HAND_EXPECTED))
def test_hand_computed_example(estimator):
    advantages = compute_advantages(estimator, HAND_REWARDS, HAND_GROUPS, eps=1e-12)
    assert_close(advantages, torch.tensor(HAND_EXPECTED[estimator], dtype=torch.float64))


def test_rloo_three_rollouts_by_hand():
    advantages = compute_advantages("rloo", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0]))
    assert_close(advantages, torch.tensor([-1.5, 0.0, 1.5]))


def test_registry_matches_the_literal_and_dispatch():
    assert set(ADVANTAGE_ESTIMATORS) == set(get_args(AdvantageEstimator))
    rewards, group_index = grouped_batch(2)
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        assert_close(
            compute_advantages(name, rewards, group_index, eps=0.5),
            estimator(rewards, group_index, 0.5),
            atol=0,
        )


def test_flash_reinforce_ignores_groups():
    rewards, group_index = grouped_batch(6)
    with_groups = compute_advantages("flash_reinforce", rewards, group_index)
    assert_close(with_groups, compute_advantages("flash_reinforce", rewards))
    assert_close(with_groups, rewards - rewards.mean())


def test_constant_float32_group_gets_exactly_zero_grpo_advantage():
    """In float32, (0.9 + 0.9 + 0.9) / 3 != 0.9: a float32 group mean would leave an
    advantage of 6e-8 / eps = 0.06 on a group that carries no signal."""
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.2], dtype=torch.float32)
    advantages = compute_advantages("grpo", rewards, torch.tensor([3, 3, 3, 9, 9]))
    assert torch.equal(advantages[:3], torch.zeros(3))
    assert torch.isfinite(advantages).all()


def test_advantages_are_detached():
    rewards = torch.tensor([1.0, 2.0, 0.5, 0.0], requires_grad=True)
    for name in ADVANTAGE_ESTIMATORS:
        assert not compute_advantages(name, rewards, torch.tensor([1, 1, 2, 2])).requires_grad


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; known: \['dr_grpo'"):
        compute_advantages("ppo", HAND_REWARDS, HAND_GROUPS)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_need_group_index(estimator):
    with pytest.raises(ValueError, match=f"^{estimator} needs group_index"):
        compute_advantages(estimator, HAND_REWARDS)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
def test_group_estimators_refuse_single_rollout_groups(estimator):
    group_index = torch.tensor([42, 7, 7, -1])
    with pytest.raises(ValueError, match=rf"^{estimator}: group \[-1, 42\] has a single rollout"):
        compute_advantages(estimator, HAND_REWARDS, group_index)


@pytest.mark.parametrize(
    ("estimator", "rewards", "group_index", "eps", "message"),
    [
        ("grpo", HAND_REWARDS, HAND_GROUPS.int(), EPS, "group_index must be torch.int64"),
        ("rloo", HAND_REWARDS, HAND_GROUPS[:3], EPS, r"group_index has shape \(3,\)"),
        ("dr_grpo", HAND_REWARDS, HAND_GROUPS[None], EPS, r"expected \(4,\)"),
        ("grpo", torch.tensor([1.0, math.nan, 0.0, 1.0]), HAND_GROUPS, EPS, "non-finite at"),
        ("flash_reinforce", torch.tensor([1.0, math.inf]), None, EPS, r"non-finite at \[1\]"),
        ("flash_reinforce", torch.tensor([1, 2]), None, EPS, "floating-point"),
        ("rloo", HAND_REWARDS[None], HAND_GROUPS, EPS, r"rewards must be \[B\]"),
        ("flash_reinforce", torch.zeros(0), None, EPS, r"rewards is empty"),
        ("grpo", torch.zeros(0), torch.zeros(0, dtype=torch.long), EPS, r"rewards is empty"),
        ("grpo", HAND_REWARDS, HAND_GROUPS, 0.0, "eps must be a finite number > 0"),
        ("reinforce_baseline", HAND_REWARDS, HAND_GROUPS, -1e-6, "eps must be"),
        ("grpo", HAND_REWARDS, HAND_GROUPS, math.nan, "eps must be"),
    ],
)
def test_bad_inputs_are_refused(estimator, rewards, group_index, eps, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(estimator, rewards, group_index, eps=eps)
