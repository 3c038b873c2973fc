"""The learner side of routing replay that needs no ranks: micro-batches carry each
trajectory's routed experts on its own positions (aligned with the tokens the model is fed)
and a balanced routing on padding; the switch is refused for a dense model and for a batch
whose trajectories carry no routing, or routing of another layout. (Replay through megatron
on real ranks: tests/distributed/test_routing_replay.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_qwen import TINY

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.config import ParallelConfig
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.learner.micro_batches import micro_batches_for_rank, plan_micro_batches
from megatron_fr.learner.routing_replay import check_routed_batch, padding_routing
from megatron_fr.models.gpt import transformer_config
from megatron_fr.models.hf_config import load_hf_config

MOE = load_hf_config(dict(TINY["qwen3_moe"], model_type="qwen3_moe"))  # 2 layers, top-2 of 4
DENSE = load_hf_config(dict(TINY["qwen3"], model_type="qwen3"))


def routing_of(tokens: list[int]) -> list[list[list[int]]]:
    """The test's router: position holding token t, layer l -> experts (t + l), (t + l + 1)."""
    return [[sorted([(t + layer) % 4, (t + layer + 1) % 4]) for layer in range(2)] for t in tokens]


def trajectory(index: int, prompt: int, response: int) -> Trajectory:
    tokens = [(7 * index + 3 * k) % 128 for k in range(prompt + response)]
    return Trajectory(
        prompt_id=f"p{index}",
        token_ids=tokens,
        action_mask=[False] * prompt + [True] * response,
        behavior_log_probs=[0.0] * prompt + [-1.0] * response,
        token_versions=[-1] * prompt + [0] * response,
        reward=float(index % 2),
        routed_experts=RoutedExperts.compact(np.array(routing_of(tokens[:-1])), 4),
    )


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dp_rank", [0, 1])
def test_micro_batches_route_every_fed_token_as_its_trajectory_and_pad_evenly(dp_rank, pack):
    shapes = [(2, 5), (4, 1), (3, 7), (2, 2), (5, 3)]
    batch = [trajectory(i, p, r) for i, (p, r) in enumerate(shapes)]
    plan = plan_micro_batches(
        [t.length for t in batch],
        dp_size=2,
        micro_batch_tokens=20,
        pack=pack,
        sequence_parallel_size=2,
    )
    micros = micro_batches_for_rank(batch, plan, dp_rank=dp_rank, routing=slice(None))
    fed = 0
    for micro in micros:
        rows, width = micro.input_ids.shape
        assert micro.routing.shape == (rows, width, 2, 2) and micro.routing.dtype == torch.uint8
        real = micro.loss_batch.segment_ids >= 0  # input position p feeds target p + 1
        chosen = micro.routing.sort(-1).values
        for row, p in real.nonzero().tolist():
            token = int(micro.input_ids[row, p])
            assert chosen[row, p].tolist() == routing_of([token])[0]
            fed += 1
        padding = chosen[~real]
        if padding.numel():
            assert (padding[..., 0] != padding[..., 1]).all() and padding.max() < 4
    share = [i for group in plan.assignment[dp_rank] for row in group for i in row]
    assert fed == sum(batch[i].length - 1 for i in share)  # every fed token, once


def test_padding_routing_spreads_tokens_evenly_over_the_experts():
    ids = padding_routing((3, 8), top_k=2, num_experts=4)
    assert ids.shape == (3, 8, 1, 2) and ids.dtype == torch.uint8
    assert torch.bincount(ids.flatten().long()).tolist() == [12] * 4
    assert padding_routing((1, 2), top_k=8, num_experts=300).dtype == torch.int16


def test_routing_replay_is_refused_for_a_dense_model():
    with pytest.raises(ValueError, match="routing_replay needs a MoE model; this one is dense"):
        transformer_config(DENSE, ParallelConfig(), routing_replay=True)


def test_a_batch_without_routing_or_of_another_layout_is_refused():
    good = trajectory(0, 2, 3)
    check_routed_batch([good], MOE)
    with pytest.raises(ValueError, match="trajectory 'p0' carries no routed experts"):
        check_routed_batch([dataclasses.replace(good, routed_experts=None)], MOE)
    three_layers = RoutedExperts.compact(np.tile([0, 1], (4, 3, 1)), 4)
    with pytest.raises(ValueError, match="of 3 layers x top-2 of 4 experts; the model has 2"):
        check_routed_batch([dataclasses.replace(good, routed_experts=three_layers)], MOE)
