"""The README's main job at small size: a megatron GPT at TP2 trained by the FlashREINFORCE
loss on two gloo ranks (megatron_fr.learner.smoke)."""

from __future__ import annotations

import math

import pytest

from megatron_fr.learner.smoke import SmokeConfig, run_rank
from megatron_fr.parallel.spawn import run_on_ranks


@pytest.mark.distributed
def test_smoke_run_trains_at_tp2_and_ranks_agree():
    config = SmokeConfig(steps=6, batch=16, response_length=6)
    per_rank = run_on_ranks(run_rank, 2, config, timeout_s=600)
    assert per_rank[0] == per_rank[1], "TP ranks must see the same losses and rewards"
    history = per_rank[0]
    assert [row["step"] for row in history] == list(range(6))
    for row in history:
        assert math.isfinite(row["loss"]) and row["loss"] != 0
        # On-policy (lag 0): behaviour and learner log-probs agree to rounding, D ~ 0.
        assert row["acceptance"] == 1.0
        assert 0.0 <= row["reward"] <= 1.0
    # The toy reward (frequency of one token in 16) is learned within a few steps.
    assert history[-1]["reward"] > history[0]["reward"] + 0.2
