"""The data path through real ranks (learner/delivery.py): a ShareSender on its own thread
(as in the rollout process) and 4 learner ranks at DP2 x TP2 (megatron's groups). Each rank
must get the step plan the sender computed and exactly the trajectories of its DP rank's share
(tokens, mask, behaviour log-probs, routed experts of its stage's layers, top-K records), the
two TP ranks of a replica the same ones, and no rank any trajectory outside its share; each
share's bytes are about half the batch's. That the learner trains a delivered share exactly as
the whole batch is checked by the golden run (tests/e2e/test_golden_steps.py: 2 ranks, each
training its own share, against losses pinned from whole-batch steps)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION, Trajectory
from megatron_fr.engine.routing import RoutedExperts
from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.parallel.spawn import run_on_ranks
from megatron_fr.utils.net import free_port

LENGTHS = [160, 36, 92, 124, 48, 200, 68, 112]
LAYERS, STAGE = 4, slice(1, 3)


def batch() -> list[Trajectory]:
    """The same seeded batch on every rank: routed experts (4 layers, top-2 of 8) and top-3
    records on every trajectory."""
    out = []
    for k, length in enumerate(LENGTHS):
        rng = np.random.default_rng(k)
        mask = np.arange(length) >= 5
        policy = int(mask.sum())
        experts = np.stack(
            [[rng.permutation(8)[:2] for _ in range(LAYERS)] for _ in range(length - 1)]
        )
        out.append(
            Trajectory(
                prompt_id=f"p{k}",
                token_ids=rng.integers(0, 1000, length),
                action_mask=mask,
                behavior_log_probs=np.where(mask, -rng.random(length), 0.0),
                token_versions=np.where(mask, 0, NON_POLICY_VERSION),
                reward=float(k % 2),
                routed_experts=RoutedExperts(experts.astype(np.uint8), 8),
                top_logprobs=TopLogProbs.of(
                    [rng.permutation(1000)[:3] for _ in range(policy)],
                    np.full((policy, 3), -2.0),
                    3,
                ),
            )
        )
    return out


def deliver(rank: int, world_size: int, port: int) -> dict:
    from megatron_fr.config.learner import LearnerConfig
    from megatron_fr.config.parallel import ParallelConfig
    from megatron_fr.learner.delivery import DataPathAddress, ShareReceiver, ShareSender
    from megatron_fr.learner.step_plan import plan_step
    from megatron_fr.parallel import state

    parallel = ParallelConfig(tensor=2)
    state.initialize(parallel)
    groups = state.process_groups()
    address = DataPathAddress("127.0.0.1", port, leaders=2, timeout_s=120)
    trajectories = batch()
    expected = plan_step(trajectories, LearnerConfig(micro_batch_tokens=256), parallel, 2)
    sent: dict[int, int] = {}
    if rank == 0:  # the rollout side, as the rollout process runs it

        def send() -> None:
            works, sizes = ShareSender(address).send(trajectories, expected)
            for work in works:
                work.wait()
            sent.update(sizes)

        sender = threading.Thread(target=send)
        sender.start()
    step, shard = ShareReceiver(groups, address, STAGE).receive()
    if rank == 0:
        sender.join()
    dp = groups.dp.rank()
    rows = shard.rows()
    for index, row in rows.items():
        original = trajectories[index]
        for name in ("token_ids", "action_mask", "behavior_log_probs"):
            assert np.array_equal(getattr(row, name), getattr(original, name)), (index, name)
        assert np.array_equal(row.routed_experts.experts, original.routed_experts.experts[:, STAGE])
        assert row.top_logprobs == original.top_logprobs
    return {
        "dp": dp,
        "received": sorted(rows),
        "share": expected.share(dp),
        "same_plan": step.plan == expected.plan
        and torch.equal(step.global_batch.advantages, expected.global_batch.advantages),
        "sent": sent,
    }


@pytest.mark.distributed
def test_every_rank_receives_exactly_its_share_and_the_plan():
    from megatron_fr.buffer.shards import pack_shard

    results = run_on_ranks(deliver, 4, free_port(), timeout_s=300)
    assert all(r["same_plan"] for r in results)
    assert sorted(r["dp"] for r in results) == [0, 0, 1, 1]
    for result in results:
        assert result["received"] == result["share"]  # the share, nothing else
    shares = {r["dp"]: r["share"] for r in results}
    assert sorted(shares[0] + shares[1]) == list(range(len(LENGTHS)))  # every one, once
    whole = pack_shard(batch(), range(len(LENGTHS)), STAGE).nbytes
    for size in results[0]["sent"].values():  # each leader: its half, and the small plan
        assert size < 0.75 * whole, (size, whole)
