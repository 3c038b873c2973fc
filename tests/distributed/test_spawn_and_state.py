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


def first_rank_works_longer_than_a_collective_may_wait(rank: int, world_size: int) -> dict:
    """A group whose collectives time out after 1 s: rank 0 works 3 s, then fails."""
    import datetime
    import time

    from megatron_fr.parallel.state import FirstRankFailed, run_on_rank0, share_from_rank0

    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=1))

    def work() -> str:
        time.sleep(3)
        return "evaluated"

    got = run_on_rank0(work if rank == 0 else None, slice_s=0.25, group=short)

    def failing() -> None:
        time.sleep(1.5)
        raise ValueError("engine pool empty")

    try:
        run_on_rank0(failing if rank == 0 else None, slice_s=0.25, group=short)
        failed = None
    except (ValueError, FirstRankFailed) as error:
        failed = (type(error).__name__, str(error))
    shared = share_from_rank0((lambda: ["pool", 3]) if rank == 0 else None, group=short)

    def refused() -> None:
        raise KeyError("no engine")

    try:  # a question that raises on rank 0: the others are told, not left in the broadcast
        share_from_rank0(refused if rank == 0 else None, group=short)
        share_failed = None
    except (KeyError, FirstRankFailed) as error:
        share_failed = (type(error).__name__, str(error))
    try:  # the same wait in one collective: the timeout fires
        box = [None]
        if rank == 0:
            time.sleep(3)
        dist.broadcast_object_list(box, src=0, group=short)
        unsliced = "returned"
    except RuntimeError:
        unsliced = "timed out"
    return dict(got=got, failed=failed, shared=shared, share_failed=share_failed, unsliced=unsliced)


@pytest.mark.distributed
def test_the_other_ranks_wait_for_the_first_ranks_work_in_slices_below_the_timeout():
    """run_on_rank0: work longer than the group's collective timeout finishes on every rank
    (the others meet rank 0 in a broadcast every slice); the work's error is rank 0's own and
    named on the others; the same wait in one collective times out (the control).
    share_from_rank0, the quick question's twin, answers and fails the same way."""
    first, second = run_on_ranks(first_rank_works_longer_than_a_collective_may_wait, 2)
    assert first["got"] == second["got"] == "evaluated"
    assert first["failed"] == ("ValueError", "engine pool empty")
    assert second["failed"] == (
        "FirstRankFailed",
        "the first rank failed: ValueError: engine pool empty",
    )
    assert second["unsliced"] == "timed out"
    # share_from_rank0: the answer on every rank; a raising question raises there as it was
    # and as FirstRankFailed naming it on the others
    assert first["shared"] == second["shared"] == ["pool", 3]
    assert first["share_failed"] == ("KeyError", "'no engine'")
    assert second["share_failed"] == (
        "FirstRankFailed",
        "the first rank failed: KeyError: 'no engine'",
    )
