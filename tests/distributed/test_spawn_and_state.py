"""The rank-spawning helper and the parallel_state wrapper, on two real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_fr.config import ParallelConfig
from megatron_fr.parallel.spawn import RankFailure, run_on_ranks


def initialize_layouts(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_fr.parallel import state

    try:
        state.initialize(ParallelConfig(tensor=3))
        refused = None
    except ValueError as error:
        refused = str(error)
    built_after_refusal = ps.model_parallel_is_initialized()
    state.initialize(ParallelConfig(tensor=2), seed=None)
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    state.initialize(ParallelConfig(context=2), seed=None)
    cp = (ps.get_context_parallel_rank(), ps.get_data_parallel_world_size())
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return dict(refused=refused, built=built_after_refusal, tp=tp, cp=cp, total=total)


def fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("rank one could not find its shard")
    dist.barrier()  # rank 0 is left waiting in a collective, as after a real failure


@pytest.mark.distributed
def test_ranks_return_in_order_and_layouts_are_validated_and_rebuilt():
    results = run_on_ranks(initialize_layouts, 2)
    for rank, result in enumerate(results):
        assert "not divisible by tensor (3)" in result["refused"]
        assert not result["built"]
        assert result["tp"] == (rank, 2)
        assert result["cp"] == (rank, 1)
        assert result["total"].item() == 3.0


@pytest.mark.distributed
def test_a_failing_rank_reports_its_traceback_and_its_peer_is_stopped():
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(fail_on_rank_one, 2, timeout_s=120)
    failures = caught.value.failures
    assert "KeyError: 'rank one could not find its shard'" in failures[1]
    assert "fail_on_rank_one" in failures[1]
    assert 0 in failures
