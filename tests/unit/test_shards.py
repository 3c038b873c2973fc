"""Trajectory shards (buffer/shards.py): packed, sent point to point over a real gloo group
(two endpoints in threads of this process) and unpacked, every trajectory's fields come back
exactly, routed experts sliced to the requested layers and top-K records split back per
trajectory; the wire size is what the tensors hold, and a shard without routing or top-K
records carries none."""

from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch.distributed as dist

from megatron_fr.buffer.shards import pack_shard, recv_shard, send_shard
from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.utils.net import free_port


def trajectory(k: int, length: int, top_k: int, layers: int = 4) -> Trajectory:
    rng = np.random.default_rng(k)
    mask = np.arange(length) >= 3
    experts = np.stack([[rng.permutation(8)[:2] for _ in range(layers)] for _ in range(length - 1)])
    policy = int(mask.sum())
    top = (
        TopLogProbs.of(
            [rng.permutation(1000)[:top_k] for _ in range(policy)],
            np.log(rng.dirichlet(np.ones(top_k + 1), policy)[:, :top_k]),
            top_k,
        )
        if top_k
        else None
    )
    return Trajectory(
        prompt_id=f"p{k}",
        token_ids=rng.integers(0, 1000, length),
        action_mask=mask,
        behavior_log_probs=np.where(mask, -rng.random(length), 0.0),
        token_versions=np.where(mask, k, NON_POLICY_VERSION),
        reward=float(k),
        routed_experts=RoutedExperts(experts.astype(np.uint8), 8),
        top_logprobs=top,
    )


def gloo_pair() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    port, timeout = free_port(), datetime.timedelta(seconds=30)
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups[0], groups[1]


@pytest.mark.parametrize(("layers", "top_k"), [(slice(1, 3), 0), (None, 0), (None, 3)])
def test_a_shard_crosses_a_gloo_group_intact(layers: slice | None, top_k: int) -> None:
    batch = [trajectory(k, length, top_k) for k, length in enumerate([7, 12, 5, 9])]
    indices = [3, 1]
    shard = pack_shard(batch, indices, layers)
    sender, receiver = gloo_pair()
    works = send_shard(sender, shard, 1)
    received = recv_shard(receiver, 0)
    for work in works:
        work.wait()
    rows = received.rows()
    assert sorted(rows) == sorted(indices)
    for index in indices:
        original, row = batch[index], rows[index]
        assert row.length == original.length
        for name in ("token_ids", "action_mask", "behavior_log_probs"):
            assert getattr(row, name).dtype == getattr(original, name).dtype
            assert np.array_equal(getattr(row, name), getattr(original, name))
        if layers is None:
            assert row.routed_experts is None
        else:
            expected = original.routed_experts.experts[:, layers]
            assert np.array_equal(row.routed_experts.experts, expected)
            assert row.routed_experts.num_experts == 8
        assert row.top_logprobs == original.top_logprobs  # both None without top-K
    tokens = 12 + 9
    routing = 0 if layers is None else (11 + 8) * 2 * 2  # positions x layers x top-2, uint8
    top = (9 + 6) * top_k * 8  # policy tokens (from position 3) x K x (int32 + float32)
    assert received.nbytes == shard.nbytes == 11 * 8 + 2 * 8 + 3 * 8 + tokens * 9 + routing + top
