"""Typed configs: layouts that cannot fit a world size are refused with the size named."""

from __future__ import annotations

import math

import pydantic
import pytest

from megatron_fr.config import (
    FlashReinforceConfig,
    LearnerConfig,
    ParallelConfig,
    WeightSyncConfig,
)


def test_data_parallel_size_is_what_the_model_parallel_sizes_leave():
    assert ParallelConfig(tensor=2, pipeline=2).data_parallel_size(8) == 2
    assert ParallelConfig(tensor=2, context=2).data_parallel_size(4) == 1
    assert ParallelConfig(expert=4).data_parallel_size(4) == 4


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (dict(tensor=3), 4, r"not divisible by tensor \(3\)"),
        (dict(tensor=2, context=2), 6, "= 4"),
        (dict(expert=3), 4, r"expert \(3\)"),
        (dict(tensor=2, expert_tensor=1, expert=8), 4, "= 8"),
        (dict(sequence_parallel=True), 2, "sequence_parallel needs tensor > 1"),
        (dict(), 0, "world_size must be >= 1"),
    ],
)
def test_layout_that_does_not_fit_is_refused(config, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**config).data_parallel_size(world)


def test_expert_tensor_defaults_to_tensor_as_in_megatron():
    assert ParallelConfig(tensor=4).effective_expert_tensor == 4
    assert ParallelConfig(tensor=4, expert_tensor=1).effective_expert_tensor == 1


@pytest.mark.parametrize("bad", [dict(tensor=0), dict(context=-1), dict(bogus=1)])
def test_parallel_config_rejects_bad_fields(bad):
    with pytest.raises(pydantic.ValidationError):
        ParallelConfig(**bad)


def test_flash_reinforce_config_ranges():
    assert FlashReinforceConfig(delta=math.inf).delta == math.inf
    for bad in (dict(delta=-1.0), dict(delta=math.nan), dict(negative_token_fraction=1.1)):
        with pytest.raises(pydantic.ValidationError):
            FlashReinforceConfig(**bad)


def test_top_k_gate_is_optional_bounded_and_asks_for_k_log_probs_only_when_used():
    """The paper's Bernoulli gate by default; the top-K gate's K is bounded (its carriage
    cost, 8 K bytes per policy token), and rollouts carry top-K log-probs only when the
    FlashREINFORCE loss gates with it."""
    assert FlashReinforceConfig().gate_kl == "bernoulli"
    assert LearnerConfig().top_logprobs == 0
    topk = {"gate_kl": "topk", "gate_top_k": 16}
    assert LearnerConfig(flash_reinforce=topk).top_logprobs == 16
    assert LearnerConfig(flash_reinforce={"gate_kl": "topk"}).top_logprobs == 8
    assert LearnerConfig(estimator="grpo", flash_reinforce=topk).top_logprobs == 0
    for bad in (dict(gate_top_k=0), dict(gate_top_k=65), dict(gate_kl="full")):
        with pytest.raises(pydantic.ValidationError):
            FlashReinforceConfig(**bad)


def test_weight_sync_config_names_what_is_wrong():
    assert WeightSyncConfig().transport == "distributed"
    with pytest.raises(pydantic.ValidationError, match="needs directory"):
        WeightSyncConfig(transport="disk")
    for bad in (dict(transport="carrier-pigeon"), dict(bucket_mib=0), dict(timeout_s=0)):
        with pytest.raises(pydantic.ValidationError):
            WeightSyncConfig(**bad)
